"""Stage timers and peak-memory probes (wall-clock; device-synchronised on CUDA)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import psutil
import torch


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory over a region: CUDA max_memory_allocated on GPU, sampled process RSS on CPU."""

    def __init__(self, device: torch.device | None = None, interval_s: float = 0.002):
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            proc = psutil.Process()
            self.peak_bytes = proc.memory_info().rss

            def sample():
                while not self._stop.wait(self.interval_s):
                    self.peak_bytes = max(self.peak_bytes, proc.memory_info().rss)

            self._thread = threading.Thread(target=sample, name="hybridrl-peak-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, psutil.Process().memory_info().rss)
        else:
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)


@dataclass
class StageTimer:
    """Accumulates named wall-clock stages: `with timer("rollout"): ...`; `timer.pop()` per step."""

    device: torch.device | None = None
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @contextlib.contextmanager
    def __call__(self, name: str):
        _sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.totals[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = dict(self.totals)
        self.totals.clear()
        return out
