"""GRPO advantages: each sample's outcome reward against its group (Shao et al., 2024).

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)     (std normalisation optional)

The same scalar is broadcast to every policy token of the sample. A group of one sample has no
baseline to compare with: its advantage is 0. The std is the unbiased sample std (as in the
paper's reference code and veRL).
"""

from __future__ import annotations

import torch

from hybridrl.algo.groups import Reduce, broadcast_to_tokens, group_stats


def advantages(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor, *,
               norm_by_std: bool = True, eps: float = 1e-6, num_groups: int | None = None,
               reduce: Reduce | None = None) -> torch.Tensor:
    """rewards [N], group_index [N] (ints), mask [N, T] -> advantages [N, T] (0 where mask is 0).
    A batch split over ranks: `reduce` and `num_groups` as in `groups.group_stats`."""
    mean, std, size = group_stats(rewards, group_index, num_groups=num_groups, reduce=reduce)
    centred = rewards.to(torch.float64) - mean
    if norm_by_std:  # an all-equal group has std 0 and centred 0: its advantage is 0, not NaN
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    centred = torch.where(size > 1, centred, torch.zeros_like(centred))
    return broadcast_to_tokens(centred, mask)
