"""The controller's critic steps for algo.advantage=gae (the trainer calls these two functions).

    values  <- critic(batch)                                   (before any update: the "old" values)
    A, R    <- GAE(outcome on the last policy token + token rewards, values), A whitened if configured
    critic  <- one step of the clipped value loss to R         (every step)
    actor   <- PPO step on A                                   (after critic.warmup_steps steps)
"""

from __future__ import annotations

from hybridrl.algo.objective import compute_gae
from hybridrl.data.batch import Batch
from hybridrl.workers.hybrid import HybridWorker


def gae_advantages(cfg, wg, batch: Batch, token_rewards=None) -> None:
    """Set batch['values'], ['advantages'] and ['returns'] from the critic's values."""
    values = wg.call(HybridWorker.compute_values, batch)["values"]
    advantages, returns = compute_gae(cfg.algo, batch["reward"], values, batch["loss_mask"],
                                      token_rewards=token_rewards)
    batch.set("values", values)
    batch.set("advantages", advantages)
    batch.set("returns", returns)


def train_critic(wg, batch: Batch) -> dict[str, float]:
    """One critic step; its metrics as critic/* (value, return, value_error, clip fraction, loss, grad_norm, lr)."""
    update = wg.call(HybridWorker.train_critic, batch)[0]
    return {f"critic/{k}": float(v) for k, v in update.items() if k not in ("num_tokens", "num_sequences")}


def actor_trains(cfg, step: int) -> bool:
    """False during critic.warmup_steps at the start of a gae run (only the critic trains)."""
    return not (cfg.algo.uses_critic and step <= cfg.critic.warmup_steps)
