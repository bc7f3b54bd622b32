"""RLOO advantages: REINFORCE with the leave-one-out mean of the group as baseline
(Kool et al., 2019; Ahmadian et al., 2024).

    A_i = r_i - (sum_g r - r_i) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g(r))

A group of one sample has no other member: its advantage is 0. Per-token rewards (KL in the
reward) are added outside the group baseline, as GRPO does (`groups.token_returns`): each policy
token gets the return of the token rewards from it on, with the configured coefficient.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from hybridrl.algo.registry import AdvantageInputs, Estimator

if TYPE_CHECKING:
    import torch

    from hybridrl.algo.groups import Reduce


def advantages(rewards: "torch.Tensor", group_index: "torch.Tensor", mask: "torch.Tensor", *,
               num_groups: int | None = None, reduce: "Reduce | None" = None) -> "torch.Tensor":
    """rewards [N], group_index [N], mask [N, T] -> advantages [N, T]. A batch split over ranks:
    `reduce` and `num_groups` as in `groups.group_stats`."""
    import torch

    from hybridrl.algo.groups import broadcast_to_tokens, group_stats

    mean, _, size = group_stats(rewards, group_index, num_groups=num_groups, reduce=reduce)
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
    return broadcast_to_tokens(scale * (rewards.to(torch.float64) - mean), mask)


def _compute(cfg, x: AdvantageInputs):
    from hybridrl.algo.groups import token_returns

    outcome = advantages(x.rewards, x.group_index, x.mask, num_groups=x.num_groups, reduce=x.reduce)
    return outcome + token_returns(x.token_rewards, x.mask), None


def _row(cfg, group_rewards: list, i: int) -> dict:
    others = group_rewards[:i] + group_rewards[i + 1:]
    return {"baseline": statistics.fmean(others) if others else 0.0}


ESTIMATOR = Estimator(
    name="rloo",
    summary="the sample's reward minus the mean reward of the other members of its group, on every policy token",
    compute=_compute,
    formula=lambda cfg: "r - mean(rewards of the other members) + the token rewards' return from the token on",
    explain_row=_row,
)
