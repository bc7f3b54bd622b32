"""Per-group statistics shared by the group-baseline estimators (GRPO, RLOO, REINFORCE++)."""

from __future__ import annotations

import torch


def group_index_of(group_ids: list) -> torch.Tensor:
    """Map arbitrary group keys (e.g. group_id strings) to dense ints, in first-seen order."""
    seen: dict = {}
    return torch.tensor([seen.setdefault(g, len(seen)) for g in group_ids], dtype=torch.long)


def group_stats(values: torch.Tensor, group_index: torch.Tensor):
    """Per-sample (mean, unbiased std, size) of the sample's group: three [N] float64 tensors."""
    values = values.to(torch.float64)
    n = int(group_index.max()) + 1 if group_index.numel() else 0
    size = torch.zeros(n, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(values))
    total = torch.zeros(n, dtype=torch.float64).index_add_(0, group_index, values)
    mean = total / size
    sq = torch.zeros(n, dtype=torch.float64).index_add_(0, group_index, (values - mean[group_index]) ** 2)
    var = torch.where(size > 1, sq / (size - 1).clamp(min=1), torch.zeros_like(sq))
    return mean[group_index], var.sqrt()[group_index], size[group_index]


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] -> [N, T]: the sample's value on each of its masked tokens, 0 elsewhere."""
    return per_sample.to(torch.float32).unsqueeze(-1) * mask.to(torch.float32)
