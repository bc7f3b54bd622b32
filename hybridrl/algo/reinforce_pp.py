"""REINFORCE++ advantages (Hu, 2025): token-level returns, a baseline, global whitening.

Per-token rewards are the (optional) KL penalty on every policy token plus the outcome reward
on the sample's last policy token; the return of a token is the sum of the rewards from it to
the end (gamma = 1, observation tokens carry no reward and are skipped). With the group
baseline ("REINFORCE++-baseline") the group's mean outcome reward is subtracted first. The
result is whitened with the mean and std over every policy token of the batch.
"""

from __future__ import annotations

import torch

from hybridrl.algo.groups import group_stats


def advantages(rewards: torch.Tensor, group_index: torch.Tensor, mask: torch.Tensor, *,
               token_rewards: torch.Tensor | None = None, baseline: str = "group",
               eps: float = 1e-6) -> torch.Tensor:
    """rewards [N], group_index [N], mask [N, T], token_rewards [N, T] (e.g. -beta*KL) -> [N, T]."""
    if baseline not in ("group", "none"):
        raise ValueError(f"REINFORCE++ baseline must be 'group' or 'none', got {baseline!r}")
    mask = mask.to(torch.float32)
    outcome = rewards.to(torch.float32)
    if baseline == "group":
        mean, _, size = group_stats(rewards, group_index)
        outcome = torch.where(size > 1, outcome - mean.float(), outcome)
    per_token = torch.zeros_like(mask) if token_rewards is None else token_rewards.to(torch.float32) * mask
    last = _last_masked_position(mask)
    has_tokens = last >= 0
    rows = torch.nonzero(has_tokens).squeeze(-1)
    per_token[rows, last[rows]] += outcome[rows]
    returns = torch.flip(torch.cumsum(torch.flip(per_token, [-1]), -1), [-1]) * mask
    return whiten(returns, mask, eps=eps)


def whiten(values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6) -> torch.Tensor:
    """(v - mean) / std over masked entries (unbiased std); 0 where mask is 0."""
    n = mask.sum()
    if n < 2:
        return torch.zeros_like(values)
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / (n - 1)
    return (values - mean) / (var.sqrt() + eps) * mask


def _last_masked_position(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[-1]).expand_as(mask)
    return torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=-1).values
