"""Micro-batches and the Megatron forward/backward schedule that runs them.

Two ways to cut a batch of right-padded sequences into micro-batches:

padded (`max_tokens_per_micro_batch=0`): `micro_batch_size` rows each, every micro-batch cut to
    its own longest sequence. Positions are 0..T-1 and attention is causal; padding sits after
    each sequence, so it never influences a real token (but is computed).
packed (`max_tokens_per_micro_batch>0`): the real tokens of several sequences are laid end to end
    in one row of at most that many tokens (first-fit, longest sequences first; a sequence longer
    than the budget gets a micro-batch of its own). Megatron runs it in its `thd` format
    (`PackedSeqParams` with cumulative sequence lengths): RoPE positions restart at every
    sequence and attention never crosses one (`attention.SDPAttention`). No padding is computed.
    With `share_prefix`, rows that begin with the same tokens (the samples of one prompt) are
    laid out as one unit: the common prefix once, then each row's own tokens (see
    `prefix_units`); the model computes the prefix once and every row's tokens attend to it.

Either way the loss function sees the micro-batch as rows [b, T_mb] (`MicroBatch.batch`, the
rows' tensors cut to their longest sequence) and the engine's per-token values are laid out in
those rows, so losses and denominators do not depend on the layout.

Mixture-of-experts models: before each micro-batch's forward its recorded routing (the batch's
`routed_experts`, when present) is handed to every sparse layer's router (`moe.set_micro_batch`:
routing replay and its metrics), and padded positions are masked out of the routers' auxiliary
losses; a training run scales those losses to the global batch's real-token count. With expert
parallelism every forward exchanges tokens with the other expert-parallel ranks, so they must run
as many micro-batches: packing can give ranks different counts, and a rank with fewer appends
fillers (its first row's first token, nothing trained: the values they produce are those of
position 0, which every per-token output leaves at 0 or recomputes identically). A filler's token
adds nothing to the routers' load-balancing and z losses (`moe.RoutingReplay.aux_loss_enabled`:
off for a filler's forward and for its recomputation), so the auxiliary terms are over real
tokens only.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from hybridrl.backends.megatron import upstream  # noqa: F401  (megatron-core imported first, there)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from hybridrl.backends.megatron import cpu_compat, moe
from hybridrl.data.batch import Batch

# Attention groups inside a pack (see `PackedSequences`): sequences sorted by length go into one
# padded SDPA call while the group's attention work (n * longest^2) stays within this factor of
# the sum of its sequences' own (sum length^2).
GROUP_WORK_SLACK = 1.5


@dataclass
class PackedSequences(PackedSeqParams):
    """Megatron's `thd` parameters for one pack, plus what our core attention and the engine need.

    groups: per attention group (sequences of similar length), `index` [n, L] positions in the
        pack gathered into a padded [n, L] block (a short sequence's tail repeats its last token:
        causal attention never lets it reach a real one), and `valid` the real positions of the
        flattened [n * L] block.
    inverse: the permutation that puts the groups' real outputs back in pack order.
    unpack: [b, T_mb] pack position of each row's token (-1 after a row ends).
    lengths: the segments of `cu_seqlens` (a shared prefix, then each row's own tokens).
    positions: per-token RoPE positions [t] when some rows share a prefix (their own tokens do not
        start at position 0 of a segment); None when every segment is a whole sequence.

    A row's "virtual sequence" is its positions in the pack (`unpack[r]`): a shared prefix's
    positions, then its own. Attention gathers each row's virtual sequence; the prefix's outputs
    are taken from the unit's first row only (`valid`), so every pack position is produced once."""

    groups: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    inverse: torch.Tensor | None = None
    unpack: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)
    positions: torch.Tensor | None = None


@dataclass
class MicroBatch:
    batch: Batch                    # this micro-batch's rows, [b, T_mb] tensors cut to T_mb
    input_ids: torch.Tensor         # model input: [b, T_mb] padded, or [1, t] packed; long, on the device
    position_ids: torch.Tensor      # same shape as input_ids
    causal_mask: torch.Tensor | None   # [1, 1, T_mb, T_mb] bool (True = masked out); None when packed
    attention_mask: torch.Tensor    # [b, T_mb] 0/1 of the rows, on the device
    rows: list[int] = field(default_factory=list)   # the rows' indices in the batch that was split
    packed: PackedSequences | None = None
    filler: bool = False            # only there so expert-parallel peers run as many forwards (see below)

    @property
    def shape(self) -> tuple[int, int]:
        """The rows' shape (b, T_mb)."""
        return tuple(self.attention_mask.shape)

    @property
    def model_shape(self) -> tuple[int, int]:
        """The model input's shape: (b, T_mb), or (1, tokens) when packed."""
        return tuple(self.input_ids.shape)

    def next_token_targets(self) -> torch.Tensor:
        """Model-input-shaped next-token ids (the last position of each sequence repeats a valid id)."""
        ids = self.input_ids
        targets = ids.clone()
        targets[:, :-1] = ids[:, 1:]
        return targets

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values in model-input layout [b_in, t_in, ...] -> rows [b, T_mb, ...]
        (0 after each row's end when packed). Differentiable."""
        if self.packed is None:
            return values
        index = self.packed.unpack
        flat = values.reshape(-1, *values.shape[2:])                           # [t, ...]
        out = flat.index_select(0, index.clamp(min=0).reshape(-1)).view(*index.shape, *flat.shape[1:])
        keep = (index >= 0).view(*index.shape, *([1] * (out.dim() - 2)))
        return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


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


def micro_batches(batch: Batch, size: int, device: torch.device, *, max_tokens: int = 0,
                  share_prefix: bool = False) -> list[MicroBatch]:
    """Split into micro-batches: `size` rows each (padded), or packs of at most `max_tokens`
    real tokens when `max_tokens > 0` (rows' common prefixes laid out once with `share_prefix`)."""
    if max_tokens > 0:
        return packed_micro_batches(batch, max_tokens, device, share_prefix=share_prefix)
    out = []
    start = 0
    for part in batch.split(size):
        rows = list(range(start, start + len(part)))
        start += len(part)
        part = _cut(part, batch["input_ids"].shape[1], device)
        ids = part["input_ids"].to(device=device, dtype=torch.long)
        b, length = ids.shape
        positions = torch.arange(length, device=device).unsqueeze(0).expand(b, -1)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).triu(1).view(1, 1, length, length)
        out.append(MicroBatch(part, ids, positions, causal, part["attention_mask"].to(device), rows))
    return out


def _cut(part: Batch, full_len: int, device: torch.device) -> Batch:
    """Every [b, full_len, ...] tensor cut to the part's longest sequence, and on the device (the
    loss function reads old logprobs, advantages, ... from it)."""
    length = int(part["attention_mask"].sum(dim=1).max())
    cut = {k: (v[:, :length] if v.dim() >= 2 and v.shape[1] == full_len else v) for k, v in part.tensors.items()}
    return Batch({k: v.to(device) for k, v in cut.items()}, part.meta, num_padding=part.num_padding)


def pack_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices per pack: first-fit over rows by decreasing length (ties by index), each pack's
    rows longest first; a row longer than `max_tokens` is a pack of its own."""
    units = [PrefixUnit([i], 0) for i in range(len(lengths))]
    return [[r for unit in pack for r in unit.rows] for pack in pack_units(units, lengths, max_tokens)]


@dataclass
class PrefixUnit:
    """Rows laid out together in a pack: their first `shared` tokens once, then each row's own."""

    rows: list[int]
    shared: int = 0

    def cost(self, lengths: list[int]) -> int:
        """Tokens the unit takes in a pack."""
        return sum(lengths[r] for r in self.rows) - (len(self.rows) - 1) * self.shared


def prefix_units(seqs: list[list[int]], max_tokens: int) -> list[PrefixUnit]:
    """Rows (token lists) cut into units whose rows share a prefix, choosing the units that save
    the most tokens, each within `max_tokens`.

    Rows sorted by their tokens put rows with long common prefixes side by side; a unit is a run of
    that order, and its shared part is the run's common prefix less one token. That last common
    token stays with every row, so that each pack position predicts one next token for all the rows
    reading it: the shared part's last position predicts the common token, each row's own first
    position its own continuation (logprobs are computed per pack position). A dynamic programme
    over the sorted order picks the runs (at most O(rows x run length) steps: a run stops growing
    when it would share nothing or exceed the budget)."""
    lengths = [len(s) for s in seqs]
    n = len(seqs)
    order = sorted(range(n), key=lambda i: seqs[i])
    common = []
    for a, b in zip(order, order[1:]):
        x, y = seqs[a], seqs[b]
        k, m = 0, min(len(x), len(y))
        while k < m and x[k] == y[k]:
            k += 1
        common.append(k)
    best = [0] * (n + 1)                  # best[j]: tokens saved over the first j rows of `order`
    start = [0] * (n + 1)                 # where the last unit of that best choice starts
    shared_of = [0] * (n + 1)
    for j in range(1, n + 1):
        best[j], start[j], shared_of[j] = best[j - 1], j - 1, 0
        prefix, total = None, lengths[order[j - 1]]
        for i in range(j - 2, -1, -1):    # the unit order[i:j]
            prefix = common[i] if prefix is None else min(prefix, common[i])
            shared = prefix - 1
            if shared < 1:
                break
            total += lengths[order[i]]
            size = j - i
            if total - (size - 1) * shared > max_tokens:
                break
            if best[i] + (size - 1) * shared > best[j]:
                best[j], start[j], shared_of[j] = best[i] + (size - 1) * shared, i, shared
    units = []
    j = n
    while j > 0:
        units.append(PrefixUnit(order[start[j]:j], shared_of[j]))
        j = start[j]
    return units[::-1]


def pack_units(units: list[PrefixUnit], lengths: list[int], max_tokens: int) -> list[list[PrefixUnit]]:
    """Units per pack: first-fit over units by decreasing cost (ties by first row), each pack's
    units costliest first; a unit over the budget (a single long row) is a pack of its own."""
    order = sorted(units, key=lambda u: (-u.cost(lengths), u.rows[0]))
    packs: list[list[PrefixUnit]] = []
    room: list[int] = []
    for unit in order:
        cost = unit.cost(lengths)
        for p, free in enumerate(room):
            if cost <= free:
                packs[p].append(unit)
                room[p] -= cost
                break
        else:
            packs.append([unit])
            room.append(max_tokens - cost)
    return packs


def packed_micro_batches(batch: Batch, max_tokens: int, device: torch.device, *,
                         share_prefix: bool = False) -> list[MicroBatch]:
    lengths = [int(n) for n in batch["attention_mask"].sum(dim=1).tolist()]
    full_len = batch["input_ids"].shape[1]
    all_ids = batch["input_ids"].tolist()
    seqs = [row[:n] for row, n in zip(all_ids, lengths)]
    units = prefix_units(seqs, max_tokens) if share_prefix else [PrefixUnit([i], 0) for i in range(len(seqs))]
    out = []
    for pack in pack_units(units, lengths, max_tokens):
        rows = [r for unit in pack for r in unit.rows]
        part = _cut(batch.select(rows), full_len, device)
        mask = part["attention_mask"].to(device)
        tokens, positions, segments, virtual, owned = [], [], [], [], []
        for unit in pack:
            s = unit.shared
            prefix = list(range(len(tokens), len(tokens) + s))
            if s:
                tokens += seqs[unit.rows[0]][:s]
                positions += range(s)
                segments.append(s)
            for k, r in enumerate(unit.rows):
                own = list(range(len(tokens), len(tokens) + lengths[r] - s))
                tokens += seqs[r][s:]
                positions += range(s, lengths[r])
                segments.append(lengths[r] - s)
                virtual.append(prefix + own)
                owned.append(len(prefix) if k else 0)      # the first row of a unit produces its prefix
        ids = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(0)
        pos = torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0)
        shared = any(unit.shared for unit in pack)
        params = _pack_params(virtual, owned, segments, pos[0] if shared else None, device)
        out.append(MicroBatch(part, ids, pos, None, mask, list(rows), params))
    return out


def _packed_params(lengths: list[int], device: torch.device) -> PackedSequences:
    """The parameters of a pack of whole sequences laid end to end."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    virtual = [list(range(starts[r], starts[r] + n)) for r, n in enumerate(lengths)]
    return _pack_params(virtual, [0] * len(lengths), list(lengths), None, device)


def _pack_params(virtual: list[list[int]], owned_from: list[int], segments: list[int],
                 positions: torch.Tensor | None, device: torch.device) -> PackedSequences:
    """virtual[r]: row r's pack positions in order (a shared prefix's, then its own); the row
    produces the outputs of virtual[r][owned_from[r]:]; segments: cu_seqlens' lengths."""
    starts = [0]
    for n in segments:
        starts.append(starts[-1] + n)
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    lengths = [len(v) for v in virtual]
    longest = max(lengths)
    unpack = torch.full((len(lengths), longest), -1, dtype=torch.long)
    for r, v in enumerate(virtual):
        unpack[r, :len(v)] = torch.tensor(v)
    # attention groups: consecutive runs of the (longest-first) sequences
    groups, dests = [], []
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    i = 0
    while i < len(order):
        j = i + 1
        work = lengths[order[i]] ** 2
        while j < len(order):
            work_next = work + lengths[order[j]] ** 2
            if (j + 1 - i) * lengths[order[i]] ** 2 > GROUP_WORK_SLACK * work_next:
                break
            work = work_next
            j += 1
        members = order[i:j]
        width = lengths[members[0]]
        index = torch.empty(len(members), width, dtype=torch.long)
        valid = torch.zeros(len(members), width, dtype=torch.bool)
        for k, r in enumerate(members):
            n = lengths[r]
            index[k, :n] = unpack[r, :n]
            index[k, n:] = unpack[r, n - 1]
            valid[k, owned_from[r]:n] = True
            dests.append(unpack[r, owned_from[r]:n])
        groups.append((index.to(device), valid.reshape(-1).nonzero().squeeze(1).to(device)))
        i = j
    inverse = torch.argsort(torch.cat(dests)).to(device)
    return PackedSequences(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(segments),
                           max_seqlen_kv=max(segments), groups=groups, inverse=inverse, unpack=unpack.to(device),
                           lengths=list(segments), positions=positions)


def run_schedule(model: torch.nn.Module, mbs: list[MicroBatch],
                 on_output: Callable[[MicroBatch, torch.Tensor], torch.Tensor], *,
                 forward_only: bool, pp: int) -> None:
    """Run every micro-batch through the pipeline (forward, and backward unless `forward_only`).

    `on_output(mb, logits)` is called on the last stage with this TP rank's vocab slice of the
    logits in model-input layout ([b, T_mb, V/tp], or [1, tokens, V/tp] packed) and returns the
    micro-batch's share of the loss (a scalar tensor)."""

    def loss_func(mb: MicroBatch, logits: torch.Tensor):
        with cpu_compat.native_ops():
            loss = on_output(mb, logits)
        # (loss, num_tokens, logged): with calculate_per_token_loss Megatron neither divides the
        # loss by the micro-batch count nor averages over DP; our losses are globally normalised.
        return loss, torch.tensor(0, dtype=torch.int), {}

    gpt = getattr(model, "module", model)                    # under Megatron's DDP wrapper
    sparse = bool(moe.replays(gpt))

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        extra = {}
        if sparse:
            moe.set_micro_batch(gpt, mb)
            extra["padding_mask"] = moe.padding_mask(mb)
        with cpu_compat.native_ops():
            if mb.packed is not None:
                with _rope_at(gpt, mb.packed.positions):
                    output = chunk(mb.input_ids, mb.position_ids, None, packed_seq_params=mb.packed, **extra)
            else:
                output = chunk(mb.input_ids, mb.position_ids, mb.causal_mask, **extra)
        return output, partial(loss_func, mb)

    if sparse:
        _even_out(mbs)
    longest = max(mb.model_shape[1] for mb in mbs)
    widest = max(mb.model_shape[0] for mb in mbs)
    moe.reset(gpt)
    scale = 1.0 if forward_only or not sparse else 1.0 / _global_real_tokens(mbs)
    with moe.aux_loss_scale(gpt, scale):
        get_forward_backward_func(pp_size=pp)(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[model],
            num_microbatches=len(mbs),
            seq_length=longest,
            micro_batch_size=widest,
            forward_only=forward_only,
        )


@contextmanager
def _rope_at(gpt, positions: torch.Tensor | None):
    """While a pack with shared prefixes runs: RoPE at each token's own position.

    Megatron's `thd` RoPE gives each `cu_seqlens` segment positions 0.. unless the frequencies it
    gets cover every token of the pack, in which case it reads each segment's slice of them at its
    offset in the pack. So the rotary module hands out the frequencies of `positions`, one per token
    (the values of the positions a whole-sequence layout would use: RoPE is elementwise in the
    position)."""
    if positions is None:
        yield
        return
    rotary = gpt.rotary_pos_emb
    table = type(rotary).forward                         # megatron's, cached per length

    def per_token(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        return table(rotary, int(positions.max()) + 1).index_select(0, positions)

    rotary.forward = per_token
    try:
        yield
    finally:
        del rotary.forward


def _even_out(mbs: list[MicroBatch]) -> None:
    """Append fillers (in place) up to the largest micro-batch count of the expert-parallel group."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    device = mbs[0].attention_mask.device
    count = torch.tensor([float(len(mbs))], dtype=torch.float64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    first = mbs[0]
    one = {k: v[:1, :1] if v.dim() >= 2 and v.shape[1] == first.shape[1] else v[:1]
           for k, v in first.batch.tensors.items()}
    if "loss_mask" in one:
        one["loss_mask"] = torch.zeros_like(one["loss_mask"])
    ids = first.batch["input_ids"][:1, :1].to(device=device, dtype=torch.long)
    for _ in range(int(count) - len(mbs)):
        mbs.append(MicroBatch(Batch(dict(one)), ids, torch.zeros_like(ids),
                              torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device),
                              first.batch["attention_mask"][:1, :1].to(device), first.rows[:1], filler=True))


def _global_real_tokens(mbs: list[MicroBatch]) -> float:
    """Real tokens of these micro-batches summed over the data-parallel group (>= 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    device = mbs[0].attention_mask.device
    total = torch.tensor([float(sum(int(mb.attention_mask.sum()) for mb in mbs if not mb.filler))], dtype=torch.float64,
                         device=device)
    group = ps.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return max(float(total), 1.0)
