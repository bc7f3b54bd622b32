"""RLOO advantages: REINFORCE with the leave-one-out mean of the group as baseline
(Kool et al., 2019; Ahmadian et al., 2024).

    A_i = r_i - (sum_g r - r_i) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g(r))

A group of one sample has no other member: its advantage is 0.
"""

from __future__ import annotations

import torch

from hybridrl.algo.groups import Reduce, broadcast_to_tokens, group_stats


def advantages(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor, *,
               num_groups: int | None = None, reduce: Reduce | None = None) -> torch.Tensor:
    """rewards [N], group_index [N], mask [N, T] -> advantages [N, T]. A batch split over ranks:
    `reduce` and `num_groups` as in `groups.group_stats`."""
    mean, _, size = group_stats(rewards, group_index, num_groups=num_groups, reduce=reduce)
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), torch.zeros_like(size))
    return broadcast_to_tokens(scale * (rewards.to(torch.float64) - mean), mask)
