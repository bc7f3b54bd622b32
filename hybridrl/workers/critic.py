"""The critic's side of the hybrid worker (algo.advantage=gae): a value model time-shared like the actor.

- built beside the actor (`CriticEngine`, same train mesh), from `critic.path` or the actor's directory;
- inside `update_policy` (one call per RL step): `_critic_values` (the "old" values GAE and the value
  clip use, before any update), `_gae` (advantages and returns over this rank's rows, whitened with
  statistics summed over the data-parallel ranks), `_train_critic` (the clipped value loss, one
  optimizer step per actor mini-batch and epoch);
- `compute_values` / `train_critic`: the single pieces as worker calls (tests, probes);
- its optimizer state and gradients leave with the actor's when the engine generates (phases
  `critic_offload` / `critic_reload` of the mode machine) and come back for training;
- saved and restored with the actor in every checkpoint (`<checkpoint>/critic`).
"""

from __future__ import annotations

from pathlib import Path

from hybridrl.data.batch import Batch
from hybridrl.distributed.dispatch import DPSplit
from hybridrl.workers.base import register
from hybridrl.workers.modes import Mode


class CriticMixin:
    """Mixed into `HybridWorker`; expects self.cfg, self.ctx, self.modes, self.spill_dir."""

    critic = None

    def _build_critic(self):
        if not self.cfg.algo.uses_critic:
            return None
        from hybridrl.algo.value_loss import make_value_loss_fn
        from hybridrl.backends.megatron.critic import CriticEngine

        cc = self.cfg.critic
        self.value_loss_fn = make_value_loss_fn(cc.value_clip)
        return CriticEngine.from_hf(cc.path or self.cfg.model.path, cc.megatron(self.cfg.train), training=True,
                                    device=self.ctx.device)

    # ------------------------------------------------------------------ training side

    @register(dispatch=DPSplit("train"))
    def compute_values(self, batch: Batch) -> Batch | None:
        """values [B, T]: the critic's, token-aligned (0 off the sequence)."""
        self.modes.require(Mode.TRAIN)
        self._require_critic()
        return self.critic.compute_values(batch)

    @register(dispatch=DPSplit("train"))
    def train_critic(self, batch: Batch) -> dict:
        """One step of the clipped value loss; the batch carries loss_mask, values (old) and returns."""
        self.modes.require(Mode.TRAIN)
        self._require_critic()
        with self.modes.phase("critic_train"):
            return self.critic.train_step(batch, self.value_loss_fn)

    def _critic_values(self, batch: Batch, temperature: float) -> None:
        """batch['values'] [B, T]: the critic's, on every rank of the last pipeline stage (0 elsewhere).
        Every rank takes part (a collective over the pipeline); nothing happens without a critic."""
        if self.critic is None:
            return
        import torch

        out = self.critic.compute_values(batch, on_last_stage=True)
        batch.set("values", out["values"].to(batch["loss_mask"].device) if out is not None
                  else torch.zeros_like(batch["loss_mask"]))

    def _gae(self, batch: Batch, token_rewards, reduce):
        """Advantages [B, T] by GAE from batch['values']; sets batch['returns'] (the value loss's target).
        Per row; whitening (algo.gae_whiten) uses the whole batch's statistics through `reduce`."""
        from hybridrl.algo.objective import compute_gae

        advantages, returns = compute_gae(self.cfg.algo, batch["reward"], batch["values"], batch["loss_mask"],
                                          token_rewards=token_rewards, reduce=reduce)
        batch.set("returns", returns)
        return advantages

    def _train_critic(self, batch: Batch, slices: list[tuple[int, int]], epochs: int) -> dict[str, float]:
        """`epochs` passes of one critic step per mini-batch slice; critic/* metrics (means over the steps,
        the last learning rate). Every rank takes part; {} without a critic."""
        if self.critic is None:
            return {}
        import time

        import torch

        if "returns" not in batch.tensors:       # ranks off the last stage compute no loss: shapes only
            batch.set("returns", torch.zeros_like(batch["loss_mask"]))
        started = time.perf_counter()
        with self.modes.phase("critic_train"):
            steps = [self.critic.train_step(batch.slice(lo, hi), self.value_loss_fn)
                     for _ in range(epochs) for lo, hi in slices]
        out = {f"critic/{k}": sum(s[k] for s in steps) / len(steps) for k in steps[0]
               if k not in ("lr", "num_tokens", "num_sequences")}
        out["critic/lr"] = steps[-1]["lr"]
        out["critic/optimizer_steps"] = float(len(steps))
        out["time/T_critic"] = time.perf_counter() - started
        return out

    def _require_critic(self) -> None:
        if self.critic is None:
            raise RuntimeError("no critic: it is built for algo.advantage=gae only")

    # ------------------------------------------------------------------ mode switches and state

    def _offload_critic(self) -> None:
        if self.critic is not None and self.cfg.critic.offload:
            spill = None if self.spill_dir is None else Path(self.spill_dir) / "critic"
            with self.modes.phase("critic_offload") as rec:
                rec.bytes_moved = self.critic.offload(optimizer=True, grads=True, spill_dir=spill)

    def _reload_critic(self) -> None:
        if self.critic is not None and self.critic._offloaded:
            with self.modes.phase("critic_reload") as rec:
                rec.bytes_moved = self.critic.reload()

    def _save_critic(self, path: str, extra: dict) -> None:
        if self.critic is not None:
            self.critic.save_checkpoint(critic_checkpoint_dir(path), extra)

    def _load_critic(self, path: str) -> None:
        if self.critic is None:
            return
        where = critic_checkpoint_dir(path)
        if not (where / "metadata.json").exists():
            raise FileNotFoundError(f"{path}: the checkpoint holds no critic ({where} is missing); it was saved by a "
                                    "run without algo.advantage=gae")
        self.critic.load_checkpoint(where)

    def _critic_memory(self) -> dict:
        if self.critic is None:
            return {}
        from hybridrl.backends.megatron.offload import held_bytes

        return {f"critic_{k}": v for k, v in held_bytes(self.critic).items()}


def critic_checkpoint_dir(model_path: str | Path) -> Path:
    """The critic's distributed checkpoint beside the actor's (`.../model` -> `.../critic`)."""
    return Path(model_path).parent / "critic"
