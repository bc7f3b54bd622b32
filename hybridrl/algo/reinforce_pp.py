"""REINFORCE++ advantages (Hu, 2025): token-level returns, a baseline, global whitening.

Per-token rewards are the (optional) KL penalty on every policy token plus the outcome reward
on the sample's last policy token; the return of a token is the sum of the rewards from it to
the end (gamma = 1, observation tokens carry no reward and are skipped). With the group
baseline ("REINFORCE++-baseline") the group's mean outcome reward is subtracted first. The
result is whitened with the mean and std over every policy token of the batch: of the whole
batch when it is split over ranks (`reduce` adds up the sums; see `groups.group_stats`).
"""

from __future__ import annotations

import torch

from hybridrl.algo.groups import Reduce, group_stats, no_reduce


def advantages(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor, *,
               token_rewards: torch.Tensor | None = None, baseline: str = "group",
               eps: float = 1e-6, num_groups: int | None = None, reduce: Reduce | None = None) -> torch.Tensor:
    """rewards [N], group_index [N], mask [N, T], token_rewards [N, T] (e.g. -beta*KL) -> [N, T]."""
    if baseline not in ("group", "none"):
        raise ValueError(f"REINFORCE++ baseline must be 'group' or 'none', got {baseline!r}")
    mask = mask.to(torch.float32)
    outcome = rewards.to(torch.float32)
    if baseline == "group":
        mean, _, size = group_stats(rewards, group_index, num_groups=num_groups, reduce=reduce)
        outcome = torch.where(size > 1, outcome - mean.float(), outcome)
    per_token = torch.zeros_like(mask) if token_rewards is None else token_rewards.to(torch.float32) * mask
    last = _last_masked_position(mask)
    has_tokens = last >= 0
    rows = torch.nonzero(has_tokens).squeeze(-1)
    per_token[rows, last[rows]] += outcome[rows]
    returns = torch.flip(torch.cumsum(torch.flip(per_token, [-1]), -1), [-1]) * mask
    return whiten(returns, mask, eps=eps, reduce=reduce)


def whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6,
           reduce: Reduce | None = None) -> torch.Tensor:
    """(v - mean) / std over masked entries (unbiased std); 0 where mask is 0. With `reduce`, the
    mean and std are those of every rank's entries together."""
    reduce = reduce or no_reduce
    v, m = values.to(torch.float64), mask.to(torch.float64)
    sums = reduce(torch.stack([m.sum(), (v * m).sum()]))
    n = float(sums[0])
    if n < 2:
        return torch.zeros_like(values)
    mean = sums[1] / n
    var = reduce(((v - mean) * m).pow(2).sum().reshape(1))[0] / (n - 1)
    return ((v - mean) / (var.sqrt() + eps) * m).to(values.dtype)


def _last_masked_position(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=-1).values
