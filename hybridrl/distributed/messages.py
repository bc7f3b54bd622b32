"""Messages of the control plane between the controller and the workers (small, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.distributed.control import ErrorReport
from hybridrl.distributed.transport import BatchHeader

SHUTDOWN = "__shutdown__"


@dataclass(frozen=True)
class Command:
    seq: int
    method: str                                  # registered name on the worker class
    kwargs: dict[str, Any] = field(default_factory=dict)
    same: BatchHeader | None = None              # a Batch broadcast to every rank
    per_rank: dict[int, BatchHeader] = field(default_factory=dict)   # a Batch per rank (p2p)
    owners: tuple[int, ...] = ()                 # ranks whose outputs are collected


@dataclass(frozen=True)
class Status:
    ok: bool
    output_kind: str = "none"                    # "none" | "batch" | "object"
    header: BatchHeader | None = None
    value: Any = None
    error: ErrorReport | None = None
