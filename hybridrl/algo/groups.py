"""Per-group statistics shared by the group-baseline estimators (GRPO, RLOO, REINFORCE++).

A batch may be split over data-parallel ranks with a group's members on several ranks. Every
statistic is then built from sums that `reduce` adds up over the ranks (an all-reduce; `None`
for a batch held whole), in two passes (the mean, then the squared deviations from it), so each
rank gets the statistics of the whole batch: the same values as one rank holding all of it.
Rows whose group index is negative (filler rows of a layout) belong to no group.
"""

from __future__ import annotations

from typing import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sum a float64 tensor over every rank that holds part of the batch (identity for one rank)."""


def no_reduce(t: torch.Tensor) -> torch.Tensor:
    return t


def group_index_of(group_ids: list) -> torch.Tensor:
    """Map arbitrary group keys (e.g. group_id strings) to dense ints, in first-seen order."""
    seen: dict = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)


def group_stats(values: torch.Tensor, group_index: torch.Tensor, *, num_groups: int | None = None,
                reduce: Reduce | None = None):
    """Per-sample (mean, unbiased std, size) of the sample's group: three [N] float64 tensors.

    With `reduce`, `num_groups` (the same on every rank) sizes the per-group sums; rows with a
    negative group index get 0 for all three."""
    reduce = reduce or no_reduce
    values = values.to(torch.float64)
    member = group_index >= 0
    index = torch.where(member, group_index, torch.zeros_like(group_index))
    weight = member.to(torch.float64)
    if num_groups is None:
        num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=values.device)
    sums = reduce(torch.stack([zeros.index_add(0, index, weight), zeros.index_add(0, index, values * weight)]))
    size, total = sums[0], sums[1]
    mean = total / size.clamp(min=1)
    sq = reduce(zeros.index_add(0, index, (values - mean[index]) ** 2 * weight))
    var = torch.where(size > 1, sq / (size - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[index] * weight, var.sqrt()[index] * weight, size[index] * weight


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, T]: the sample's value on each of its masked tokens, 0 elsewhere."""
    return per_sample.to(torch.float32).unsqueeze(-1) * mask.to(torch.float32)


def whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float, reduce: Reduce | None = None,
           single: str = "zero") -> torch.Tensor:
    """(v - mean) / (std + eps) over the masked entries (unbiased std), 0 off-mask, float32. With
    `reduce`, the mean and std are those of every rank's entries together (two passes, as
    `group_stats`). Fewer than two entries in all have no std: `single='zero'` gives 0,
    `single='keep'` returns the values unchanged (masked)."""
    reduce = reduce or no_reduce
    v, m = values.to(torch.float64), mask.to(torch.float64)
    sums = reduce(torch.stack([m.sum(), (v * m).sum()]))
    n = float(sums[0])
    if n < 2:
        return torch.zeros_like(values, dtype=torch.float32) if single == "zero" else (v * m).to(torch.float32)
    mean = sums[1] / n
    var = reduce(((v - mean) * m).pow(2).sum().reshape(1))[0] / (n - 1)
    return ((v - mean) / (var.sqrt() + eps) * m).to(torch.float32)


def token_returns(token_rewards: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] float32: each policy token's return of the per-token rewards (e.g. -kl_coef * KL), the sum
    of those on it and on the row's later policy tokens (gamma = 1), 0 off the policy tokens; zeros
    without token rewards.

    The group-baseline estimators add it to the group-normalised outcome advantage, outside the group
    statistics, so the per-token reward trains with exactly the coefficient it was configured with (inside
    the std division its scale would be kl_coef / std_g, a different one per group) and it reaches the
    tokens that caused it (a token's advantage holds only the rewards from it on)."""
    m = mask.to(torch.float32)
    if token_rewards is None:
        return torch.zeros_like(m)
    r = token_rewards.to(torch.float32) * m
    return torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]) * m
