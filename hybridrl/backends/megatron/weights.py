"""Weights in and out of the Megatron model, through the family adapter.

`load_hf_weights`: every rank reads only the HF tensors of the slots its stage holds (lazily,
from safetensors) and copies its TP shard into the parameters.
`iter_hf_tensors`: the whole model as full HF tensors, sorted by name, on every rank of the
model-parallel group: per fused group, an all-gather over TP on the owning stage, the adapter's
`to_hf`, then a broadcast over PP. At most one layer's worth of tensors is held at a time.
An expert's weights live on one expert-parallel rank of the owning stage: it gathers them over the
expert-tensor-parallel group and broadcasts them over the expert-parallel group, so every rank
ends with the whole model (experts included) as with dense models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from hybridrl.backends.megatron import upstream  # noqa: F401  (megatron-core imported first, there)
from megatron.core import parallel_state as ps

from hybridrl.backends.megatron.adapters import DecoderAdapter, Slot, Split


class HFCheckpoint:
    """Lazy reader of an HF directory's safetensors (single file or sharded with an index)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files, weight_map = [single.name], None
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or model.safetensors.index.json "
                                    "(only safetensors checkpoints are supported)")
        self._handles = {f: safe_open(str(self.dir / f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = {k: files[0] for k in self._handles[files[0]].keys()}
        self._file_of = weight_map

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"{self.dir}: checkpoint has no tensor '{name}'")
        return self._handles[self._file_of[name]].get_tensor(name)


class _Lazy(Mapping):
    """A Mapping view of a checkpoint that reads tensors on access."""

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt = ckpt

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.ckpt.get(name)

    def __iter__(self):
        return iter(self.ckpt.names())

    def __len__(self) -> int:
        return len(self.ckpt.names())


def owned_params(adapter: DecoderAdapter, model, layers) -> dict[Slot, torch.nn.Parameter]:
    """The slots this stage holds, with their parameters (unwrapped GPTModel)."""
    out = {}
    for slot in adapter.slots():
        param = adapter.megatron_param(model, slot, layers)
        if param is not None:
            out[slot] = param
    return out


def load_hf_weights(adapter: DecoderAdapter, params: Mapping[Slot, torch.nn.Parameter],
                    model_dir: str | Path) -> int:
    """Copy this rank's shard of every owned slot from the HF checkpoint; returns elements loaded."""
    ckpt = _Lazy(HFCheckpoint(model_dir))
    missing = sorted({n for slot in params for n in slot.hf_names} - set(ckpt.ckpt.names()))
    if missing:
        raise KeyError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank() if adapter.spec.is_moe else tp_rank
    loaded = 0
    with torch.no_grad():
        for slot, param in params.items():
            shard = adapter.from_hf(slot, ckpt, etp_rank if slot.expert is not None else tp_rank)
            if shard.shape != param.shape:
                raise ValueError(f"{slot}: adapter built {tuple(shard.shape)}, model expects {tuple(param.shape)}")
            param.copy_(shard)
            loaded += shard.numel()
    return loaded


def slot_owners(adapter: DecoderAdapter, params: Mapping[Slot, torch.nn.Parameter]) -> dict[Slot, int]:
    """Exported slot -> the pipeline stage (pp rank) that holds it, agreed by all stages. (An expert's
    slot belongs to the stage of its layer, whichever expert-parallel rank there holds it.)"""
    index = {slot: i for i, slot in enumerate(adapter.slots())}
    layers = {s.layer for s in params if s.layer is not None}
    mine = sorted(i for s, i in index.items() if s.exported and (s in params or (s.expert is not None and s.layer in layers)))
    group = ps.get_pipeline_model_parallel_group()
    per_stage: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_stage, mine, group=group)
    slots = adapter.slots()
    owners: dict[Slot, int] = {}
    for stage, held in enumerate(per_stage):
        for i in held:
            owners.setdefault(slots[i], stage)
    unowned = [str(s) for s in slots if s.exported and s not in owners]
    if unowned:
        raise RuntimeError(f"no pipeline stage holds {unowned}")
    return owners


def gather_slot(adapter: DecoderAdapter, slot: Slot, param: torch.Tensor | None, owner: int,
                shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
    """Full HF tensors of one slot on every rank of this model-parallel group."""
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    if pp_rank == owner and param is not None:
        full = adapter.to_hf(slot, _tp_shards(adapter, slot, param))
        full = {n: t.contiguous() for n, t in full.items()}
    else:
        full = {n: torch.empty(shapes[n], dtype=dtype, device=device) for n in slot.hf_names}
    if pp_rank == owner:
        _broadcast_expert(adapter, slot, full)
    if dist.get_world_size(pp_group) > 1:
        src = dist.get_global_rank(pp_group, owner)
        for name in slot.hf_names:
            dist.broadcast(full[name], src=src, group=pp_group)
    return full


def _tp_shards(adapter: DecoderAdapter, slot: Slot, param: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's shard of `slot` (experts: every expert-TP rank's), gathered; one when replicated."""
    local = param.detach()
    n = adapter.tp_of(slot)
    if slot.split is Split.NONE or n == 1:
        return [local]
    group = ps.get_expert_tensor_parallel_group() if slot.expert is not None else ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(n)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def _broadcast_expert(adapter: DecoderAdapter, slot: Slot, full: Mapping[str, torch.Tensor]) -> None:
    """An expert's full tensors from the expert-parallel rank that holds it to the others of its stage."""
    owner = adapter.ep_owner(slot)
    if owner is None or adapter.ep == 1:
        return
    group = ps.get_expert_model_parallel_group()
    src = dist.get_global_rank(group, owner)
    for name in slot.hf_names:
        dist.broadcast(full[name], src=src, group=group)


def iter_hf_tensors(adapter: DecoderAdapter, params: Mapping[Slot, torch.nn.Parameter],
                    owners: Mapping[Slot, int], *, dtype: torch.dtype,
                    device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every exported tensor, names sorted, identical on all MP ranks."""
    slot_of = adapter.slot_of_hf_name()
    shapes = adapter.hf_shapes()
    pending: dict[str, torch.Tensor] = {}      # the other members of a group already gathered
    for name in adapter.hf_names():
        if name not in pending:
            slot = slot_of[name]
            pending.update(gather_slot(adapter, slot, params.get(slot), owners[slot], shapes, dtype, device))
        yield name, pending.pop(name)
    assert not pending, f"ungathered tensors left: {sorted(pending)}"


def iter_hf_groups(adapter: DecoderAdapter, params: Mapping[Slot, torch.nn.Parameter],
                   owners: Mapping[Slot, int], *, dtype: torch.dtype,
                   device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """One publication group (`adapter.groups()`: a slot's HF tensors, e.g. q/k/v, or one expert's
    gate/up/down) at a time, in model order, identical on all MP ranks: what weight publication
    buckets without splitting a group."""
    shapes = adapter.hf_shapes()
    for group in adapter.groups():
        out = []
        for slot in group:
            full = gather_slot(adapter, slot, params.get(slot), owners[slot], shapes, dtype, device)
            out += [(name, full[name]) for name in slot.hf_names]
        yield out


def group_specs(adapter: DecoderAdapter, dtype: torch.dtype) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
    """`adapter.groups()` as (HF name, shape, dtype) lists, known without gathering."""
    shapes = adapter.hf_shapes()
    return [[(name, tuple(shapes[name]), dtype) for slot in group for name in slot.hf_names]
            for group in adapter.groups()]


def lendable_views(adapter: DecoderAdapter, params: Mapping[Slot, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """HF name -> a view of this rank's own parameter, for every exported slot held whole here: where the HF
    layout is the parameter's own, in the HF shape (`adapter.to_hf` of its one shard is a view; a padded
    vocabulary's first rows); the fused q/k/v, which Megatron interleaves per KV group, as views [groups,
    rows per group, *rest] whose elements are the HF tensor's in its order (`adapter.grouped_qkv`), which an
    engine that keeps that layout serves as they are. Call at PP = 1."""
    out: dict[str, torch.Tensor] = {}
    for slot, param in params.items():
        if not slot.exported or adapter.tp_of(slot) != 1 or (slot.expert is not None and adapter.ep != 1):
            continue
        if slot.split is Split.QKV:
            out.update(zip(slot.hf_names, adapter.grouped_qkv(param.detach())))
        else:
            out.update(adapter.to_hf(slot, [param.detach()]))
    return out


def write_group(adapter: DecoderAdapter, index: int, params: Mapping[Slot, torch.nn.Parameter],
                owners: Mapping[Slot, int], out: Mapping[str, torch.Tensor]) -> None:
    """Publication group `index` of `adapter.groups()` written into `out[name]` on every rank."""
    for slot in adapter.groups()[index]:
        write_hf_group(adapter, slot, params.get(slot), owners[slot], out)


def write_hf_group(adapter: DecoderAdapter, slot: Slot, param: torch.Tensor | None, owner: int,
                   out: Mapping[str, torch.Tensor]) -> None:
    """`gather_slot` written straight into the caller's tensors `out[name]` (a publication's flat
    bucket) on every rank of this model-parallel group: the owning stage gathers over TP and
    un-fuses into `out` (`adapter.write_hf`; an expert: its expert-parallel rank, which then
    broadcasts over the expert-parallel group), then broadcasts `out` over PP."""
    pp_group = ps.get_pipeline_model_parallel_group()
    if ps.get_pipeline_model_parallel_rank() == owner:
        if param is not None:
            adapter.write_hf(slot, _tp_shards(adapter, slot, param), out)
        _broadcast_expert(adapter, slot, out)
    if dist.get_world_size(pp_group) > 1:
        src = dist.get_global_rank(pp_group, owner)
        for name in slot.hf_names:
            dist.broadcast(out[name], src=src, group=pp_group)
