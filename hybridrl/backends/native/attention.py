"""Paged attention: write the step's K/V into their slots, then attend through the block tables.

Decodes take one of two paths (`rollout.native.kernels`): on the CPU in float32 the C kernel
(`cpu_kernels.py`) reads each row's keys in place, all rows in one call per layer (`DecodeBatch`);
otherwise (plain torch: CUDA, other dtypes) each row's blocks are gathered and
`scaled_dot_product_attention` runs with a position mask. Prefill chunks always take the torch path:
many queries per sequence are what SDPA's blocked kernels are made for.

Layout of one layer's cache: [num_blocks, block_size, 2, kv_heads, head_dim] (K and V of a
token side by side, so one `index_copy_` writes both and one `index_select` gathers both).
The flat token batch is ordered decodes first, then prefill chunks. On the torch path decodes are
one query per sequence, sorted by context length and split into a few groups so that short
sequences are not gathered to the longest one's length (`split_by_width`); prefill chunks are
padded to the longest chunk (or used as is when there is one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridrl.backends.native.cpu_kernels import paged_decode


@dataclass
class PrefillGroup:
    """The prefill chunks of one step: P sequences, Q_max queries each after padding."""

    num_seqs: int
    max_queries: int
    block_tables: torch.Tensor            # [P, blocks]
    mask: torch.Tensor | None             # [P, 1, Q_max, blocks * block_size] bool; None when `fresh`
    pad_index: torch.Tensor | None        # [P * Q_max] prefill-local row of each padded query (P > 1)
    unpad_index: torch.Tensor | None      # [num_prefill_tokens] padded row of each real query (P > 1)
    fresh: bool = False                   # one sequence, chunk starts at position 0: causal on its own K/V


@dataclass
class DecodeGroup:
    """Decode rows [start, end) of the flat batch, gathered to the same number of blocks."""

    start: int
    end: int
    block_tables: torch.Tensor            # [end - start, blocks]
    mask: torch.Tensor                    # [end - start, 1, 1, blocks * block_size] additive: 0 or -inf


@dataclass
class DecodeBatch:
    """Every decode row of the step for the C kernel: no padding is read, no mask needed."""

    block_tables: torch.Tensor            # [num_decodes, blocks] int64 (rows shorter than the widest padded)
    context_lens: torch.Tensor            # [num_decodes] int64: tokens each row's query sees (position + 1)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                   # [N] cache slot (block * block_size + offset) of each token
    num_decodes: int = 0
    decode_groups: list[DecodeGroup] | None = None
    decode_batch: DecodeBatch | None = None      # set instead of decode_groups on the kernel path
    prefill: PrefillGroup | None = None


def split_by_width(widths: list[int], penalty: int, max_depth: int = 2) -> list[tuple[int, int]]:
    """Cut rows sorted by width (descending) into at most 2**max_depth contiguous groups, where a cut
    pays off: cost = rows x widest row of the group, + `penalty` per extra group."""
    def split(lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
        best, cut = (hi - lo) * widths[lo], None
        if depth > 0:
            for i in range(lo + 1, hi):
                if widths[i] == widths[i - 1]:
                    continue
                cost = (i - lo) * widths[lo] + (hi - i) * widths[i] + penalty
                if cost < best:
                    best, cut = cost, i
        if cut is None:
            return [(lo, hi)]
        return split(lo, cut, depth - 1) + split(cut, hi, depth - 1)

    return split(0, len(widths), max_depth) if widths else []


def write_kv(kv_layer: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_layer [blocks, block_size, 2, kv_heads, head_dim] <- kv [N, 2, kv_heads, head_dim] at slots [N]."""
    flat = kv_layer.view(-1, *kv_layer.shape[2:])
    flat.index_copy_(0, slot_mapping, kv)


def gather_kv(kv_layer: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of each row's blocks, [S, kv_heads, blocks * block_size, head_dim] each (strided views)."""
    num_seqs, num_blocks = block_tables.shape
    block_size = kv_layer.shape[1]
    g = kv_layer.index_select(0, block_tables.reshape(-1))
    g = g.view(num_seqs, num_blocks * block_size, *kv_layer.shape[2:])
    return g[:, :, 0].transpose(1, 2), g[:, :, 1].transpose(1, 2)


def paged_attention(q: torch.Tensor, kv_new: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q [N, heads, head_dim], kv_new [N, 2, kv_heads, head_dim] (already written) -> [N, heads * head_dim]."""
    n, heads, hd = q.shape
    outs = []
    d = meta.num_decodes
    kv_heads = kv_layer.shape[3]
    if meta.decode_batch is not None:
        outs.append(paged_decode(q[:d], kv_layer, meta.decode_batch.block_tables, meta.decode_batch.context_lens,
                                 scale))
    for group in meta.decode_groups or ():
        rows = group.end - group.start
        k, v = gather_kv(kv_layer, group.block_tables)
        # GQA as rows: the query heads sharing a KV head are that head's "queries" (one pass over K/V,
        # about 2x faster on CPU than enable_gqa); query head h uses KV head h // (heads / kv_heads)
        qg = q[group.start:group.end].view(rows, kv_heads, heads // kv_heads, hd)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=group.mask, scale=scale)  # [rows, kv, g, hd]
        outs.append(o.reshape(rows, heads * hd))
    pre = meta.prefill
    if pre is not None:
        qp = q[d:]
        if pre.fresh:
            k = kv_new[d:, 0].unsqueeze(0).transpose(1, 2)
            v = kv_new[d:, 1].unsqueeze(0).transpose(1, 2)
            o = F.scaled_dot_product_attention(qp.unsqueeze(0).transpose(1, 2), k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
            outs.append(o.transpose(1, 2).reshape(n - d, heads * hd))
        else:
            p, qmax = pre.num_seqs, pre.max_queries
            if pre.pad_index is not None:
                qp = qp.index_select(0, pre.pad_index)
            qp = qp.view(p, qmax, heads, hd).transpose(1, 2)
            k, v = gather_kv(kv_layer, pre.block_tables)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=pre.mask, scale=scale, enable_gqa=True)
            o = o.transpose(1, 2).reshape(p * qmax, heads * hd)
            if pre.unpad_index is not None:
                o = o.index_select(0, pre.unpad_index)
            outs.append(o)
    return outs[0] if len(outs) == 1 else torch.cat(outs)
