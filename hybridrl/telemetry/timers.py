"""Stage timers and peak-memory probes (wall-clock; device-synchronised on CUDA)."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import psutil
import torch

from hybridrl.telemetry import spans


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _proc_files(pid: int) -> tuple[int, int] | None:
    """This process's /proc/<pid>/status (read) and clear_refs (write), opened once per process: a
    phase of a mode switch reads and resets its peak with one system call each (`pid` keys the cache,
    so a forked child opens its own instead of reading its parent's)."""
    try:
        return os.open(f"/proc/{pid}/status", os.O_RDONLY), os.open(f"/proc/{pid}/clear_refs", os.O_WRONLY)
    except OSError:
        return None


def _vm_hwm() -> int | None:
    """This process's peak RSS since the last reset (Linux VmHWM), in bytes."""
    files = _proc_files(os.getpid())
    try:
        text = os.pread(files[0], 8192, 0) if files is not None else b""
    except OSError:
        return None
    start = text.find(b"VmHWM:")
    if start < 0:
        return None
    return int(text[start + 6: text.index(b"kB", start)]) * 1024


def _reset_vm_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    files = _proc_files(os.getpid())
    try:
        return files is not None and os.write(files[1], b"5") == 1
    except OSError:
        return False


@functools.cache
def _vm_hwm_resettable() -> bool:
    """Whether this process can reset VmHWM and read it back: learned once, so that entering a region
    (every phase of a mode switch) does not read /proc/self/status as well."""
    return _reset_vm_hwm() and _vm_hwm() is not None


class PeakMemory:
    """Peak memory over a region: CUDA max_memory_allocated on GPU; on CPU the kernel's own peak
    RSS (VmHWM, reset at entry), or, where it cannot be reset, RSS sampled by a thread."""

    def __init__(self, device: torch.device | None = None, interval_s: float = 0.002):
        self.device = device
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._kernel = False

    def __enter__(self) -> "PeakMemory":
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        self._kernel = _vm_hwm_resettable() and _reset_vm_hwm()
        if self._kernel:
            return self
        proc = psutil.Process()
        self.peak_bytes = proc.memory_info().rss

        def sample():
            while not self._stop.wait(self.interval_s):
                self.peak_bytes = max(self.peak_bytes, proc.memory_info().rss)

        self._thread = threading.Thread(target=sample, name="hybridrl-peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device is not None and self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        elif self._kernel:
            self.peak_bytes = _vm_hwm() or 0
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, psutil.Process().memory_info().rss)


@dataclass
class StageTimer:
    """Accumulates named wall-clock stages: `with timer("rollout"): ...`; `timer.pop()` per step."""

    device: torch.device | None = None
    totals: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    @contextlib.contextmanager
    def __call__(self, name: str):
        _sync(self.device)
        with spans.span(name):          # the run's timeline and live phase (telemetry/spans.py, live.py)
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
