"""The RL objective, assembled from the configured pieces (the trainer never branches on names).

`compute_advantages(cfg, ...)` picks the estimator; `make_loss_fn(cfg)` returns the per-token
loss the training engine aggregates:

    token_loss = tis_weight * pg_loss  +  kl_coef * KL (when kl_in == 'loss')  -  entropy_coef * H

The micro-batch must carry `old_logprobs`, `advantages`, and as configured `ref_logprobs`
(KL in the loss) and `behavior_logprobs` (truncated importance sampling), all [b, T] token-aligned.
With `make_loss_fn(cfg, old_from_forward=True)` (one optimizer step per rollout batch) the
training forward's own detached logprobs are the old logprobs: the ratio is 1 by construction,
its gradient is the policy gradient, and no separate old-logprob forward is needed.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.algo import correction, gae, grpo, kl, ppo_clip, reinforce_pp, rloo
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.groups import Reduce
from hybridrl.data.batch import Batch

LossFn = Callable[[torch.Tensor, "torch.Tensor | None", Batch], tuple[torch.Tensor, dict[str, torch.Tensor]]]

_ADVANTAGES = {
    "grpo": lambda cfg, r, g, m, tr, **kw: grpo.advantages(r, g, m, norm_by_std=cfg.norm_adv_by_std, **kw),
    "rloo": lambda cfg, r, g, m, tr, **kw: rloo.advantages(r, g, m, **kw),
    "reinforce_pp": lambda cfg, r, g, m, tr, **kw: reinforce_pp.advantages(r, g, m, token_rewards=tr,
                                                                           baseline=cfg.reinforce_baseline, **kw),
}
_POLICY_LOSSES = {
    "ppo_clip": lambda cfg, lp, old, adv: ppo_clip.loss(lp, old, adv, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                                        dual_clip=cfg.dual_clip or None),
}
__all__ = ["compute_advantages", "compute_gae", "kl_token_rewards", "make_loss_fn"]


def compute_advantages(cfg: AlgoConfig, rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor,
                       *, token_rewards: torch.Tensor | None = None, num_groups: int | None = None,
                       reduce: Reduce | None = None) -> torch.Tensor:
    """rewards [N] (outcome), group_index [N], mask [N, T], token_rewards [N, T] -> advantages [N, T].

    A batch split over data-parallel ranks (groups may straddle ranks): pass `reduce` (a sum over
    the ranks) and `num_groups`; every statistic is then the whole batch's (`groups.group_stats`)."""
    if token_rewards is not None and cfg.advantage in ("grpo", "rloo"):
        # outcome-only estimators: fold per-token rewards (e.g. KL-in-reward) into the outcome
        rewards = rewards + (token_rewards * mask).sum(dim=-1)
    if cfg.advantage == "gae":
        raise ValueError("gae needs the critic's values: use compute_gae(cfg, rewards, values, mask)")
    return _ADVANTAGES[cfg.advantage](cfg, rewards, group_index, mask, token_rewards, num_groups=num_groups,
                                      reduce=reduce)


def compute_gae(cfg: AlgoConfig, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                *, token_rewards: torch.Tensor | None = None,
                reduce: Reduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N] (outcome, on each row's last policy token), values [N, T] (the critic's, token-aligned),
    mask [N, T], token_rewards [N, T] -> (advantages [N, T] (whitened if cfg.gae_whiten), returns [N, T]).
    GAE is per row; with `reduce` (a sum over the ranks holding the batch) the whitening statistics are
    the whole batch's."""
    adv, returns = gae.advantages(gae.outcome_token_rewards(rewards, mask, token_rewards), values, mask,
                                  gamma=cfg.gamma, lam=cfg.lam)
    return (gae.whiten(adv, mask, reduce=reduce) if cfg.gae_whiten else adv), returns


def kl_token_rewards(cfg: AlgoConfig, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """-kl_coef * KL per policy token (for kl_in == 'reward')."""
    return -cfg.kl_coef * kl.kl(logprobs, ref_logprobs, cfg.kl_estimator) * mask


def make_loss_fn(cfg: AlgoConfig, *, old_from_forward: bool = False) -> LossFn:
    policy_loss = _POLICY_LOSSES[cfg.policy_loss]

    def loss_fn(logprobs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch):
        old = logprobs.detach() if old_from_forward else mb["old_logprobs"]
        token_loss, metrics = policy_loss(cfg, logprobs, old, mb["advantages"])
        if cfg.tis_cap > 0:
            w = correction.tis_weights(old, mb["behavior_logprobs"], cfg.tis_cap)
            token_loss = token_loss * w
            metrics["tis_weight"] = w
        metrics["pg_loss"] = token_loss.detach()
        if cfg.kl_coef > 0 and cfg.kl_in == "loss":
            k = kl.kl(logprobs, mb["ref_logprobs"], cfg.kl_estimator)
            token_loss = token_loss + cfg.kl_coef * k
            metrics["kl"] = k.detach()
        if entropy is not None:
            metrics["entropy"] = entropy.detach()
            if cfg.entropy_coef > 0:
                token_loss = token_loss - cfg.entropy_coef * entropy
        return token_loss, metrics

    return loss_fn
