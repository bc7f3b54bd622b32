"""Micro-batches and the Megatron forward/backward schedule that runs them.

A batch of right-padded sequences is split into micro-batches of `micro_batch_size` rows; each
is cut to its own longest sequence (every [b, T, ...] tensor of the micro-batch `Batch` is cut
the same way, so the loss function sees matching shapes). Positions are 0..T-1 and attention is
causal; padding sits after each sequence, so it never influences a real token.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from hybridrl.backends.megatron import cpu_compat
from hybridrl.data.batch import Batch


@dataclass
class MicroBatch:
    batch: Batch                    # this micro-batch's rows, [b, T_mb] tensors cut to T_mb
    input_ids: torch.Tensor         # [b, T_mb] long, on the device
    position_ids: torch.Tensor      # [b, T_mb]
    causal_mask: torch.Tensor       # [1, 1, T_mb, T_mb] bool, True = masked out
    attention_mask: torch.Tensor    # [b, T_mb] 0/1, on the device

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)


def check_sequence_batch(batch: Batch) -> None:
    """`input_ids` [B, T] integer and `attention_mask` [B, T], right-padded, >= 1 token per row."""
    for name in ("input_ids", "attention_mask"):
        if name not in batch.tensors:
            raise KeyError(f"batch needs '{name}' [B, T]; it holds {sorted(batch.tensors)}")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be an integer [B, T] tensor, got {ids.dtype} {tuple(ids.shape)}")
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} and input_ids {tuple(ids.shape)} differ in shape")
    m = mask.bool()
    if len(batch) and not bool(m[:, 0].all()):
        raise ValueError("every row needs at least one token at position 0 (right padding expected; "
                         "left-padded rows are not supported)")
    if m.shape[1] > 1 and bool((m[:, 1:] & ~m[:, :-1]).any()):
        raise ValueError("attention_mask must be right-padded: ones, then zeros, in every row")


def micro_batches(batch: Batch, size: int, device: torch.device) -> list[MicroBatch]:
    """Split into micro-batches of at most `size` rows, each cut to its longest sequence."""
    out = []
    full_len = batch["input_ids"].shape[1]
    for part in batch.split(size):
        length = int(part["attention_mask"].sum(dim=1).max())
        cut = {k: (v[:, :length] if v.dim() >= 2 and v.shape[1] == full_len else v)
               for k, v in part.tensors.items()}
        # every tensor on the device: the loss function reads old logprobs, advantages, ... from it
        part = Batch({k: v.to(device) for k, v in cut.items()}, part.meta, num_padding=part.num_padding)
        ids = part["input_ids"].to(device=device, dtype=torch.long)
        b = ids.shape[0]
        positions = torch.arange(length, device=device).unsqueeze(0).expand(b, -1)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).triu(1).view(1, 1, length, length)
        out.append(MicroBatch(part, ids, positions, causal, part["attention_mask"].to(device)))
    return out


def run_schedule(model: torch.nn.Module, mbs: list[MicroBatch],
                 on_output: Callable[[MicroBatch, torch.Tensor], torch.Tensor], *,
                 forward_only: bool, pp: int) -> None:
    """Run every micro-batch through the pipeline (forward, and backward unless `forward_only`).

    `on_output(mb, logits)` is called on the last stage with this TP rank's vocab slice of the
    logits [b, T_mb, V/tp] and returns the micro-batch's share of the loss (a scalar tensor)."""

    def loss_func(mb: MicroBatch, logits: torch.Tensor):
        with cpu_compat.native_ops():
            loss = on_output(mb, logits)
        # (loss, num_tokens, logged): with calculate_per_token_loss Megatron neither divides the
        # loss by the micro-batch count nor averages over DP; our losses are globally normalised.
        return loss, torch.tensor(0, dtype=torch.int), {}

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        with cpu_compat.native_ops():
            output = chunk(mb.input_ids, mb.position_ids, mb.causal_mask)
        return output, partial(loss_func, mb)

    longest = max(mb.shape[1] for mb in mbs)
    widest = max(mb.shape[0] for mb in mbs)
    get_forward_backward_func(pp_size=pp)(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[model],
        num_microbatches=len(mbs),
        seq_length=longest,
        micro_batch_size=widest,
        forward_only=forward_only,
    )
