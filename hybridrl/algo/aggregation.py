"""Loss aggregation with globally correct denominators (token and sample denominators counted over the whole global batch).

A loss is computed per token ([B, T] values with a [B, T] 0/1 mask) and reduced to a scalar
by one of three modes. The denominators are *global*: counted over the whole global batch
(every micro-batch on every data-parallel rank) before the first backward, so that summing
the micro-batch losses and the data-parallel gradients gives the same update as one big batch.

  token-mean            sum_{b,t} m*v / N_tokens
  seq-mean-token-sum    sum_{b,t} m*v / N_seqs
  seq-mean-token-mean   sum_b (sum_t m*v / sum_t m) / N_seqs

N_seqs counts sequences with at least one unmasked token (padding rows have none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass(frozen=True)
class Denominators:
    num_tokens: float
    num_sequences: float

    def __add__(self, other: "Denominators") -> "Denominators":
        return Denominators(self.num_tokens + other.num_tokens, self.num_sequences + other.num_sequences)


def count(mask: torch.Tensor) -> Denominators:
    """Local counts of a [B, T] mask (sum these over micro-batches and ranks for the global ones)."""
    per_seq = mask.float().sum(dim=-1)
    return Denominators(float(per_seq.sum()), float((per_seq > 0).sum()))


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, denominators: Denominators) -> torch.Tensor:
    """Reduce per-token `values` [B, T] under `mask` [B, T] to this slice's share of the global loss."""
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ in shape")
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token-mean":
        return masked.sum() / max(denominators.num_tokens, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(denominators.num_sequences, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / max(denominators.num_sequences, 1.0)
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATIONS}")
