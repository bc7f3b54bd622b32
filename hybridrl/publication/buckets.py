"""Flat buckets: each bucket of a publication is one flat byte buffer with a view per tensor.

The plan (`plan_buckets`) is made from names, shapes and dtypes only, before anything is
gathered: fused groups (q/k/v of one layer, gate/up) are never split, and a group larger than
the bucket size travels alone. The sender writes each group straight into its views (un-fusing
Megatron's QKV included: no intermediate HF tensors), so a bucket moves as one buffer: one copy
per bucket for an engine whose storage is laid out in the same order, one handle for an IPC or
one broadcast for a process-group transport. The layout is the one SGLang's flattened buckets use
(byte offsets into a uint8 tensor), so a transport can hand it over as it is. An engine in this
process may offer its own storage as the destination (`InPlaceBucket`): the sender then writes
into it and no bucket is copied.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hybridrl.publication.digest import tensor_digests

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]         # (HF name, shape, dtype)


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int                     # byte offsets into the bucket's buffer
    end: int

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


@dataclass
class BucketPlan:
    groups: list[int] = field(default_factory=list)            # indices of the fused groups it holds
    entries: list[Entry] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.entries[-1].end if self.entries else 0


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


def plan_buckets(groups: Sequence[Sequence[TensorSpec]], bucket_bytes: int) -> list[BucketPlan]:
    """Group i of `groups` is a list of (name, shape, dtype); buckets of whole groups, in order.
    Every publication of a run has the same groups: the plans of the last call are reused (they are
    not modified by anyone), so a switch does not re-plan its buckets."""
    return _plans(tuple(tuple((name, tuple(shape), dtype) for name, shape, dtype in group) for group in groups),
                  bucket_bytes)


@functools.lru_cache(maxsize=8)
def _plans(groups: tuple[tuple[TensorSpec, ...], ...], bucket_bytes: int) -> list[BucketPlan]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    plans: list[BucketPlan] = []
    plan = BucketPlan()
    for index, group in enumerate(groups):
        size = sum(nbytes(shape, dtype) for _, shape, dtype in group)
        if plan.entries and plan.nbytes + size > bucket_bytes:
            plans.append(plan)
            plan = BucketPlan()
        plan.groups.append(index)
        for name, shape, dtype in group:
            itemsize = dtype.itemsize
            start = -(-plan.nbytes // itemsize) * itemsize          # aligned to the element size
            plan.entries.append(Entry(name, tuple(shape), dtype, start, start + nbytes(shape, dtype)))
    if plan.entries:
        plans.append(plan)
    return plans


class _Views:
    """What every bucket has: its plan and a view per tensor (name -> tensor of the entry's shape, dtype)."""

    plan: BucketPlan
    views: dict[str, torch.Tensor]

    def named(self, names: Sequence[str] | None = None) -> list[tuple[str, torch.Tensor]]:
        return [(n, self.views[n]) for n in (names if names is not None else self.views)]

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {e.name: tuple(e.shape) for e in self.plan.entries}

    def digests(self, names: Sequence[str] | None = None) -> dict[str, str]:
        """The sender's digests, of each tensor in its entry's shape (an engine's view may have another:
        q/k/v it serves in a trainer's per-group layout)."""
        return tensor_digests([(n, t.reshape(self.shapes[n])) for n, t in self.named(names)])


class FlatBucket(_Views):
    """One bucket's buffer and its views."""

    def __init__(self, plan: BucketPlan, buffer: torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < plan.nbytes:
            raise ValueError(f"a bucket of {plan.nbytes} bytes needs a 1-D uint8 buffer at least that large")
        self.plan = plan
        self.buffer = buffer[: plan.nbytes]
        self.views = {e.name: self.buffer[e.start: e.end].view(e.dtype).view(e.shape) for e in plan.entries}

    @property
    def device(self) -> torch.device:
        return self.buffer.device


class InPlaceBucket(_Views):
    """A bucket whose views are the engine's own tensors (`writable_views`): the source writes the
    new weights straight into the engine, and nothing is delivered afterwards but the commit."""

    def __init__(self, plan: BucketPlan, views: dict[str, torch.Tensor]):
        self.plan = plan
        self.views = views
        self.device = next(iter(views.values())).device if views else torch.device("cpu")


class Staging:
    """Reusable bucket buffers on one device: `slots` of them, so the next bucket is written while
    the previous one is still being delivered. Grown on demand, kept between publications (a fresh
    buffer costs page faults on first touch); `release()` frees them (on CUDA back to the driver)."""

    def __init__(self, device: torch.device, slots: int = 2):
        self.device = torch.device(device)
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._made: list[FlatBucket | None] = [None] * slots     # the last bucket of each slot (its views)

    def bucket(self, plan: BucketPlan, slot: int) -> FlatBucket:
        slot %= len(self._buffers)
        buf = self._buffers[slot]
        if buf is None or buf.numel() < plan.nbytes:
            self._buffers[slot] = self._made[slot] = None
            buf = self._buffers[slot] = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)
        made = self._made[slot]
        if made is None or made.plan is not plan:
            made = self._made[slot] = FlatBucket(plan, buf)
        return made

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)

    def release(self) -> None:
        """Drop the buffers. On CUDA their memory also leaves torch's caching allocator: freed blocks
        stay reserved by this process until `empty_cache()`, out of reach of an engine in other
        processes (SGLang's KV cache), so ~`slots` x bucket size would stay taken during rollout."""
        held = any(b is not None for b in self._buffers)
        self._buffers = [None] * len(self._buffers)
        self._made = [None] * len(self._made)
        if held and self.device.type == "cuda":
            torch.cuda.empty_cache()
