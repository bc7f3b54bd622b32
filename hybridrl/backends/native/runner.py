"""`ModelRunner`: turns a `StepPlan` into tensors, runs the forward pass and samples.

It owns the KV-cache tensor ([layers, blocks, block_size, 2, kv_heads, head_dim], one
allocation, zero-initialised so that masked padding reads finite values) and, for MoE models, the
routing cache beside it ([moe_layers, blocks * block_size, top_k] expert ids, int8 up to 128 experts),
and can free and re-allocate both (sleep / wake_up). Everything per sequence happens here in a few list
comprehensions; the per-token work is vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.backends.native.attention import (AttentionMetadata, DecodeBatch, DecodeGroup, PrefillGroup,
                                                 split_by_width)
from hybridrl.backends.native.model import CausalLM
from hybridrl.backends.native.sampler import SamplingBatch, sample
from hybridrl.backends.native.scheduler import Sequence, StepPlan


@dataclass
class StepResult:
    sampled: list[Sequence]          # the sequence of each sampled row, in row order (one row per verified draft too)
    tokens: list[int]
    logprobs: list[float]


class ModelRunner:
    """A model with the C kernels (`model.kernels`) has its decodes attend through the kernel, all rows in
    one call per layer, instead of gathered groups and SDPA."""

    def __init__(self, model: CausalLM, *, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        spec = model.spec
        self.kv_shape = (spec.num_layers, num_blocks, block_size, 2, spec.num_kv_heads, spec.head_dim)
        self.kv_cache: torch.Tensor | None = None
        self.routing_shape = ((spec.num_moe_layers, num_blocks * block_size, spec.num_experts_per_tok)
                              if spec.is_moe else None)
        self.routing: torch.Tensor | None = None     # [moe_layers, slots, top_k]: expert ids per KV slot
        self._arange_cache = torch.arange(0, device=device)
        # a decode group costs a few fixed op launches per layer: worth about 256 KiB of gathered KV
        block_bytes = block_size * 2 * spec.num_kv_heads * spec.head_dim * torch.empty((), dtype=dtype).element_size()
        self.group_penalty_blocks = max(4, (256 * 1024) // block_bytes)
        self.num_decode_groups = 0                 # counter: decode attention groups run (per layer)

    # -- memory -------------------------------------------------------------------------------

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv_cache, self.routing) if t is not None)

    def allocate_kv(self) -> None:
        if self.kv_cache is None:
            self.kv_cache = torch.zeros(self.kv_shape, dtype=self.dtype, device=self.device)
        if self.routing_shape is not None and self.routing is None:
            self.routing = torch.full(self.routing_shape, -1, dtype=self.model.spec.routing_dtype, device=self.device)

    def free_kv(self) -> None:
        self.kv_cache = None
        self.routing = None

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy-on-write of partial prefixes: rows [0, n) of block src into block dst, every layer
        (the routing record of those tokens with them)."""
        bs = self.block_size
        for src, dst, rows in copies:
            self.kv_cache[:, dst, :rows] = self.kv_cache[:, src, :rows]
            if self.routing is not None:
                self.routing[:, dst * bs: dst * bs + rows] = self.routing[:, src * bs: src * bs + rows]

    def read_routing(self, seq: Sequence) -> torch.Tensor | None:
        """The expert ids every computed token of `seq` was routed to, [num_computed, moe_layers, top_k]
        on the CPU (None for a dense model). Read before the sequence's blocks are released."""
        if self.routing is None:
            return None
        bs, n = self.block_size, seq.num_computed
        blocks = torch.tensor(seq.blocks, dtype=torch.long)
        positions = torch.arange(n)
        slots = (blocks[positions // bs] * bs + positions % bs).to(self.device)
        return self.routing.index_select(1, slots).permute(1, 0, 2).contiguous().cpu()

    # -- a step -------------------------------------------------------------------------------

    def _arange(self, n: int) -> torch.Tensor:
        if self._arange_cache.numel() < n:
            self._arange_cache = torch.arange(max(n, 2 * self._arange_cache.numel()), device=self.device)
        return self._arange_cache[:n]

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.copies:
            self.copy_blocks(plan.copies)
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled: list[Sequence] = []
        logits_rows: list[int] = []
        indices: list[int] = []                      # output index of each sampled row (its uniform's index)
        meta = AttentionMetadata(slot_mapping=None)  # type: ignore[arg-type]

        # decode rows longest context first: on the torch path groups of similar length are then contiguous,
        # and the kernel's threads take the longest rows first. A sequence with drafts has one row per
        # token it verifies (its last token, then each draft), side by side: rows of one sequence differ
        # only in their position, and each attends to the cache up to its own position
        decodes = sorted(plan.decodes, key=lambda seq: len(seq.blocks), reverse=True)
        if decodes:
            rows: list[Sequence] = []
            for seq in decodes:
                p = seq.num_computed
                for j, token in enumerate([seq.tokens[p], *plan.drafts.get(seq, ())]):
                    ids.append(token)
                    positions.append(p + j)
                    slots.append(seq.blocks[(p + j) // bs] * bs + (p + j) % bs)
                    rows.append(seq)
                    indices.append(seq.num_generated + j)
            widths = [len(seq.blocks) for seq in rows]
            meta.num_decodes = len(rows)
            if self.model.kernels is not None:
                width = widths[0]
                tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in rows], dtype=torch.long)
                meta.decode_batch = DecodeBatch(tables, torch.tensor(positions, dtype=torch.long).add_(1))
            else:
                meta.decode_groups = self._decode_groups(rows, widths, positions)
                self.num_decode_groups += len(meta.decode_groups)
            sampled.extend(rows)
            logits_rows.extend(range(len(rows)))

        prefills = plan.prefills
        if prefills:
            meta.prefill = self._prefill_group(prefills, ids, positions, slots)
            row = meta.num_decodes
            for seq, n in prefills:
                row += n
                if seq.num_computed + n == len(seq.tokens):
                    sampled.append(seq)
                    logits_rows.append(row - 1)
                    indices.append(seq.num_generated)

        long = torch.long
        meta.slot_mapping = torch.tensor(slots, dtype=long, device=dev)
        logits = self.model.forward(torch.tensor(ids, dtype=long, device=dev),
                                    torch.tensor(positions, dtype=long, device=dev), meta, self.kv_cache,
                                    torch.tensor(logits_rows, dtype=long, device=dev), self.routing)
        if not sampled:
            return StepResult([], [], [])
        batch = SamplingBatch.build(
            [(s.params.temperature, s.params.top_k, s.params.top_p, s.seed, i) for s, i in zip(sampled, indices)],
            logits.shape[-1], dev)
        tokens, logprobs = sample(logits, batch)
        return StepResult(sampled, tokens.tolist(), logprobs.tolist())

    def _decode_groups(self, decodes: list[Sequence], widths: list[int], positions: list[int]) -> list[DecodeGroup]:
        """The torch path's decode rows (sorted by width; `decodes` has each row's sequence) cut into groups
        gathered to their widest row."""
        bs, dev = self.block_size, self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        groups = []
        for start, end in split_by_width(widths, self.group_penalty_blocks):
            width = widths[start]
            tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in decodes[start:end]],
                                  dtype=torch.long, device=dev)
            visible = self._arange(width * bs).unsqueeze(0) <= pos[start:end].unsqueeze(1)
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(~visible, float("-inf"))
            groups.append(DecodeGroup(start, end, tables, mask[:, None, None, :]))
        return groups

    def _prefill_group(self, prefills: list[tuple[Sequence, int]], ids: list[int], positions: list[int],
                       slots: list[int]) -> PrefillGroup:
        bs, dev = self.block_size, self.device
        qmax = max(n for _, n in prefills)
        width = max(len(s.blocks) for s, _ in prefills)
        starts = []
        for seq, n in prefills:
            start = seq.num_computed
            starts.append(start)
            ids.extend(seq.tokens[start:start + n])
            positions.extend(range(start, start + n))
            blocks = seq.blocks
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
        tables = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s, _ in prefills], device=dev)
        if len(prefills) == 1:
            seq, n = prefills[0]
            if starts[0] == 0:
                return PrefillGroup(num_seqs=1, max_queries=n, block_tables=tables, mask=None, pad_index=None,
                                    unpad_index=None, fresh=True)
            q_pos = torch.arange(starts[0], starts[0] + n, device=dev).unsqueeze(0)            # [1, n]
            mask = (self._arange(width * bs).view(1, 1, -1) <= q_pos.unsqueeze(2)).unsqueeze(1)
            return PrefillGroup(num_seqs=1, max_queries=n, block_tables=tables, mask=mask, pad_index=None,
                                unpad_index=None)
        # several chunks: pad each to qmax queries (padding queries sit at position 0 and are dropped)
        pad_index, unpad_index, q_pos = [], [], []
        offset = 0
        for p, (seq, n) in enumerate(prefills):
            pad_index.extend(range(offset, offset + n))
            pad_index.extend([offset] * (qmax - n))
            unpad_index.extend(range(p * qmax, p * qmax + n))
            q_pos.extend(range(starts[p], starts[p] + n))
            q_pos.extend([0] * (qmax - n))
            offset += n
        q_pos_t = torch.tensor(q_pos, device=dev).view(len(prefills), qmax)
        mask = (self._arange(width * bs).view(1, 1, -1) <= q_pos_t.unsqueeze(2)).unsqueeze(1)
        return PrefillGroup(num_seqs=len(prefills), max_queries=qmax, block_tables=tables, mask=mask,
                            pad_index=torch.tensor(pad_index, device=dev),
                            unpad_index=torch.tensor(unpad_index, device=dev))
