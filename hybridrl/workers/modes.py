"""The hybrid worker's mode state machine: training and generation time-share one device, and
every phase of a switch is timed with its memory.

    TRAIN --(offload optimizer/grads)--> RESHARD --(stream weights, publish)--> ROLLOUT
      ^                                                                             |
      +------------------(release KV cache, reload optimizer/grads)------------------+

A failed RESHARD returns to TRAIN (the engine keeps its previous version). Any other move raises
`IllegalTransition`. Each phase records wall time, bytes moved and peak memory.
"""

from __future__ import annotations

import contextlib
import enum
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from hybridrl.telemetry.timers import PeakMemory


class Mode(str, enum.Enum):
    TRAIN = "train"
    RESHARD = "reshard"
    ROLLOUT = "rollout"


_ALLOWED = {
    Mode.TRAIN: {Mode.RESHARD},
    Mode.RESHARD: {Mode.ROLLOUT, Mode.TRAIN},
    Mode.ROLLOUT: {Mode.TRAIN},
}


class IllegalTransition(RuntimeError):
    pass


@dataclass
class PhaseRecord:
    seconds: float
    bytes_moved: int
    peak_mem_bytes: int


class ModeMachine:
    def __init__(self, device: torch.device | None = None, start: Mode = Mode.TRAIN):
        self.mode = start
        self.device = device
        self.history: dict[str, list[PhaseRecord]] = defaultdict(list)

    def require(self, *modes: Mode) -> None:
        if self.mode not in modes:
            raise IllegalTransition(f"operation needs mode {' or '.join(m.value for m in modes)}; "
                                    f"the worker is in {self.mode.value}")

    def to(self, target: Mode) -> None:
        if target not in _ALLOWED[self.mode]:
            raise IllegalTransition(f"{self.mode.value} -> {target.value} is not a legal mode switch")
        self.mode = target

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a phase; the body sets `rec.bytes_moved`. Yields a mutable record."""
        rec = PhaseRecord(0.0, 0, 0)
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with PeakMemory(self.device) as peak:
            start = time.perf_counter()
            yield rec
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            rec.seconds = time.perf_counter() - start
        rec.peak_mem_bytes = peak.peak_bytes
        self.history[name].append(rec)

    def last(self) -> dict[str, dict[str, float]]:
        return {name: {"seconds": recs[-1].seconds, "bytes": recs[-1].bytes_moved,
                       "peak_mem_bytes": recs[-1].peak_mem_bytes} for name, recs in self.history.items() if recs}

    def summary(self) -> dict[str, dict[str, float]]:
        """Median seconds / bytes and max peak memory of every phase so far."""
        return {name: {"median_s": statistics.median(r.seconds for r in recs),
                       "bytes": int(statistics.median(r.bytes_moved for r in recs)),
                       "peak_mem_bytes": max(r.peak_mem_bytes for r in recs), "count": len(recs)}
                for name, recs in self.history.items() if recs}
