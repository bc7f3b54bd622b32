"""Progress as plain lines, for output that is not a terminal (a log file, a pipe, a batch job).

A tqdm bar on a terminal; redirected, tqdm prints nothing, and a log that stays silent for minutes
looks like a hung run. `LineProgress` prints a line per ~10% of the steps instead: the step, what
the caller passes (loss, reward), seconds per step and the time left at that rate.
"""

from __future__ import annotations

import sys
import time
from typing import IO


def fmt_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class LineProgress:
    def __init__(self, name: str, total: int, *, start: int = 0, enabled: bool = True, every_pct: int = 10,
                 stream: IO[str] | None = None, unit: str = "step"):
        self.name, self.total, self.start, self.unit = name, total, start, unit
        self.enabled, self.every_pct = enabled and total > 0, every_pct
        self.stream = stream or sys.stderr
        self.started = time.perf_counter()
        self.next_pct = every_pct * (100 * start // (every_pct * total) + 1) if total else 100

    def update(self, step: int, **fields: object) -> None:
        """After `step` is done; prints when it crosses the next 10% (and at the last step)."""
        if not self.enabled or (100 * step < self.next_pct * self.total and step != self.total):
            return
        self.next_pct = self.every_pct * (100 * step // (self.every_pct * self.total) + 1)
        done = step - self.start
        per_step = (time.perf_counter() - self.started) / done if done else 0.0
        parts = [f"{self.name} {self.unit} {step}/{self.total} ({100 * step // self.total}%)"]
        parts += [f"{k.replace('_', ' ')} {v}" for k, v in fields.items()]
        parts.append(f"{per_step:.2f} s/{self.unit}")
        if step < self.total:
            parts.append(f"ETA {fmt_duration(per_step * (self.total - step))}")
        self.note(": ".join(parts[:1]) + ": " + ", ".join(parts[1:]) if len(parts) > 1 else parts[0])

    def note(self, text: str) -> None:
        """A line of its own (a validation result), when lines are on."""
        if self.enabled:
            print(text, file=self.stream, flush=True)
