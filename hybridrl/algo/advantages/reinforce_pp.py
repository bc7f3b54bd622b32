"""REINFORCE++ advantages (Hu, 2025): token-level returns, a baseline, global whitening.

Per-token rewards are the (optional) KL penalty on every policy token plus the outcome reward
on the sample's last policy token; the return of a token is the sum of the rewards from it to
the end (gamma = 1, observation tokens carry no reward and are skipped). With the group
baseline ("REINFORCE++-baseline", algo.reinforce_baseline=group) the group's mean outcome reward
is subtracted first. The result is whitened with the mean and std over every policy token of
the batch: of the whole batch when it is split over ranks (`reduce` adds up the sums).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.algo.registry import AdvantageInputs, Estimator

if TYPE_CHECKING:
    import torch

    from hybridrl.algo.groups import Reduce


def advantages(rewards: "torch.Tensor", group_index: "torch.Tensor", mask: "torch.Tensor", *,
               token_rewards: "torch.Tensor | None" = None, baseline: str = "group",
               eps: float = 1e-6, num_groups: int | None = None, reduce: "Reduce | None" = None) -> "torch.Tensor":
    """rewards [N], group_index [N], mask [N, T], token_rewards [N, T] (e.g. -beta*KL) -> [N, T]."""
    import torch

    from hybridrl.algo.advantages.gae import outcome_token_rewards
    from hybridrl.algo.groups import group_stats, whiten

    if baseline not in ("group", "none"):
        raise ValueError(f"REINFORCE++ baseline must be 'group' or 'none', got {baseline!r}")
    mask = mask.to(torch.float32)
    outcome = rewards.to(torch.float32)
    if baseline == "group":
        mean, _, size = group_stats(rewards, group_index, num_groups=num_groups, reduce=reduce)
        outcome = torch.where(size > 1, outcome - mean.float(), outcome)
    per_token = outcome_token_rewards(outcome, mask, token_rewards)
    returns = torch.flip(torch.cumsum(torch.flip(per_token, [-1]), -1), [-1]) * mask
    return whiten(returns, mask, eps=eps, reduce=reduce, single="zero")


def _compute(cfg, x: AdvantageInputs):
    return advantages(x.rewards, x.group_index, x.mask, token_rewards=x.token_rewards,
                      baseline=cfg.reinforce_baseline, num_groups=x.num_groups, reduce=x.reduce), None


ESTIMATOR = Estimator(
    name="reinforce_pp",
    summary="per-token returns (the outcome, minus the group's mean with algo.reinforce_baseline=group, plus later "
            "token rewards), whitened over the batch's policy tokens",
    compute=_compute,
    formula=lambda cfg: ("whiten(suffix sum of token rewards + (r - group mean) on the last policy token)"
                         if cfg.reinforce_baseline == "group" else
                         "whiten(suffix sum of token rewards + r on the last policy token)")
                        + " over the batch's policy tokens",
    group_baseline=lambda cfg: cfg.reinforce_baseline == "group",
)
