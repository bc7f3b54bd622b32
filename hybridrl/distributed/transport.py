"""The data plane for the controller's batches: tensors point-to-point over the job's data group
(`Peers`: job ranks, whichever placement built the group).

A `Batch` is split into a small header (names, shapes, dtypes, per-sample metadata) that
travels in control messages, and its tensors, which travel here. On NCCL the tensors are moved
to the rank's device before sending; on gloo they stay on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.data.batch import Batch
from hybridrl.distributed.peers import Peers


@dataclass(frozen=True)
class BatchHeader:
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
    meta: dict[str, list[Any]]
    num_padding: int
    info: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(batch: Batch) -> "BatchHeader":
        return BatchHeader(batch.tensor_meta(), batch.meta, batch.num_padding, batch.info)

    @property
    def num_bytes(self) -> int:
        total = 0
        for shape, dtype in self.tensors.values():
            numel = 1
            for s in shape:
                numel *= s
            total += numel * torch.empty((), dtype=dtype).element_size()
        return total


def _wire(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = t.to(device, non_blocking=False).contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


class PendingSends:
    """Sends in flight; their buffers stay alive until `wait()` returns."""

    def __init__(self) -> None:
        self._works: list[dist.Work] = []
        self._buffers: list[torch.Tensor] = []

    def add(self, work: dist.Work, buffer: torch.Tensor) -> None:
        self._works.append(work)
        self._buffers.append(buffer)

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        self._buffers.clear()


def send_batch(batch: Batch, dst: int, peers: Peers, device: torch.device,
               pending: PendingSends | None = None) -> PendingSends:
    """Start sending every tensor of `batch` to job rank `dst`; `wait()` on the result."""
    pending = pending if pending is not None else PendingSends()
    for t in batch.tensors.values():
        if t.numel():
            wire = _wire(t, device)
            pending.add(peers.isend(wire, dst), wire)
    return pending


def recv_batch(header: BatchHeader, src: int, peers: Peers, device: torch.device) -> Batch:
    tensors = {}
    for name, (shape, dtype) in header.tensors.items():
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        buf = torch.empty(shape, dtype=wire_dtype, device=device)
        if buf.numel():
            peers.recv(buf, src)
        tensors[name] = buf.view(torch.bool) if dtype == torch.bool else buf
    return Batch(tensors, header.meta, num_padding=header.num_padding, info=header.info)


def broadcast_batch(batch: Batch | None, header: BatchHeader, src: int, peers: Peers,
                    device: torch.device) -> Batch:
    """Every rank of `peers` calls this; `batch` is only read on `src`."""
    tensors = {}
    for name, (shape, dtype) in header.tensors.items():
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        if batch is not None and peers.me == src:
            buf = _wire(batch.tensors[name], device)
        else:
            buf = torch.empty(shape, dtype=wire_dtype, device=device)
        if buf.numel():
            peers.broadcast(buf, src)
        tensors[name] = buf.view(torch.bool) if dtype == torch.bool else buf
    return Batch(tensors, header.meta, num_padding=header.num_padding, info=header.info)
