"""Dispatch modes: how a call's data is shared out to the ranks and whose outputs come back.

A worker method declares its mode with `@register(dispatch=...)`; a call may override it.

- `ONE_TO_ALL`  every rank runs the method with the same arguments (a Batch is broadcast);
                outputs of every rank come back as a list in rank order (`OneToAll("rank0")`:
                rank 0's output only). `OneToAll(mesh="rollout")`: the ranks of that mesh (the
                ranks holding the part whose method it is) answer, in their order; "rank0" is
                then the mesh's first rank.
- `DPSplit(mesh)` the Batch is padded to a multiple of the mesh's data-parallel size and split;
                each rank receives the chunk of its dp index (ranks of one dp group, e.g. TP
                peers, receive the same chunk); the output of each dp group's output rank comes
                back, concatenated in dp order with the padding stripped.
- `RANK0`       only rank 0 runs it; no message is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from hybridrl.data.batch import Batch
from hybridrl.distributed.mesh import Mesh


class Group(Protocol):
    """What a dispatch mode needs of the caller's worker group (`controller.WorkerGroup`)."""

    @property
    def world_size(self) -> int: ...

    def mesh(self, name: str) -> Mesh: ...


@dataclass
class Plan:
    """What one call sends where, and how to put the outputs back together."""

    same: Batch | None = None                                  # broadcast to every rank
    per_rank: dict[int, Batch] = field(default_factory=dict)   # point-to-point per rank
    owners: list[int] = field(default_factory=list)
    gather: Callable[[dict[int, Any]], Any] = lambda outputs: outputs


class Dispatch:
    runs_everywhere = True

    def plan(self, data: Batch | None, wg: Group) -> Plan:
        raise NotImplementedError


@dataclass(frozen=True)
class OneToAll(Dispatch):
    collect: str = "all"   # "all" | "rank0" (the mesh's first rank)
    mesh: str = "world"

    def __post_init__(self) -> None:
        if self.collect not in ("all", "rank0"):
            raise ValueError(f"OneToAll(collect=...) takes 'all' or 'rank0', got {self.collect!r}")

    def plan(self, data: Batch | None, wg: Group) -> Plan:
        if data is not None and not isinstance(data, Batch):
            raise TypeError(f"data must be a Batch or None, got {type(data).__name__}: pass other "
                            "arguments by keyword, group.call(method, name=value)")
        ranks = list(range(wg.world_size)) if self.mesh == "world" else list(wg.mesh(self.mesh).ranks)
        if self.collect == "rank0":
            first = ranks[0]
            return Plan(same=data, owners=[first], gather=lambda outs: outs[first])
        return Plan(same=data, owners=ranks, gather=lambda outs: [outs[r] for r in ranks])


@dataclass(frozen=True)
class DPSplit(Dispatch):
    mesh: str = "world"
    zero_on_pad: tuple[str, ...] = ("loss_mask", "response_mask")   # zeroed in padding rows
    pad_outputs: tuple[tuple[str, float], ...] = ()   # output tensors right-padded on dim 1 to a common length

    def plan(self, data: Batch | None, wg: Group) -> Plan:
        if not isinstance(data, Batch):
            raise TypeError(f"DPSplit needs a Batch to split, got {type(data).__name__}")
        if len(data) == 0:
            raise ValueError("DPSplit got an empty batch")
        if data.num_padding:
            raise ValueError("DPSplit got a batch that is already padded; strip it first")
        mesh = wg.mesh(self.mesh)
        padded = data.pad_to_multiple(mesh.dp_size, zero=[k for k in self.zero_on_pad if k in data.tensors])
        chunks = padded.chunk(mesh.dp_size)
        per_rank = {r: chunks[mesh.dp_rank(r)] for r in mesh.ranks}
        owners = mesh.output_ranks()

        def gather(outputs: dict[int, Any]) -> Any:
            ordered = [outputs[r] for r in owners]
            if not all(isinstance(o, Batch) for o in ordered):
                return ordered
            pieces = []
            for owner, out in zip(owners, ordered):
                chunk = chunks[mesh.dp_rank(owner)]
                if len(out) != len(chunk):
                    raise ValueError(
                        f"rank {owner} returned {len(out)} rows for a chunk of {len(chunk)}: a DPSplit "
                        "method must return one output row per input row")
                pieces.append(out.slice(0, chunk.num_valid))
            return Batch.concat(pieces, pad_dim1=dict(self.pad_outputs) or None)

        return Plan(per_rank=per_rank, owners=owners, gather=gather)


@dataclass(frozen=True)
class Rank0(Dispatch):
    runs_everywhere = False

    def plan(self, data: Batch | None, wg: Group) -> Plan:
        return Plan(same=data, owners=[0], gather=lambda outs: outs[0])


ONE_TO_ALL = OneToAll()
RANK0 = Rank0()
