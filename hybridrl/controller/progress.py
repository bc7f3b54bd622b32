"""What the console shows while an RL run goes: a run observer (see `controller/callbacks.py`).

On a terminal, a progress bar with the last step's reward, loss and validation accuracy. When the
output is a file or a pipe (a log, a batch job), a bar draws nothing, so a line instead, at every
~10% of the steps (and the last one), or when `line_every_s` passed since the previous line:

    rl: step 8/20 (40%): reward 0.562, loss 0.0132, val accuracy 43.8%, 2.41 s/step, ETA 29s

A step that validated adds its accuracy (each validation is a log line of its own too); a step
without an update says why.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import IO

from hybridrl.telemetry.progress import fmt_duration as duration

log = logging.getLogger("hybridrl.controller.trainer")


def fields(m: dict) -> list[str]:
    out = []
    if m.get("reward/mean") is not None:
        out.append(f"reward {m['reward/mean']:.3f}")
    if m.get("loss") is not None:
        out.append(f"loss {m['loss']:.4f}")
    if m.get("val/accuracy") is not None:
        out.append(f"val accuracy {100 * m['val/accuracy']:.1f}%")
    return out


class Progress:
    def __init__(self, total_steps: int, *, stream: IO[str] | None = None, terminal: bool | None = None,
                 every_pct: int = 10, line_every_s: float = 120.0):
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.every_pct, self.line_every_s = every_pct, line_every_s
        self.bar = None
        self.first = 0
        self.started = self.last_line = time.monotonic()

    def on_start(self, run: dict) -> None:
        self.first = run["step"]
        self.started = self.last_line = time.monotonic()
        if self.terminal:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.first, desc="rl", dynamic_ncols=True, file=self.stream)

    def on_step(self, step: int, metrics: dict) -> None:
        if step == 0:
            return
        if not metrics.get("train/updated", 1.0):
            reasons = {k[len("filter/"):]: int(v) for k, v in metrics.items() if k.startswith("filter/") and v}
            log.info("step %d: no update (none of %d episodes admitted: %s)", step, int(metrics.get("episodes", 0)),
                     ", ".join(f"{k} {v}" for k, v in reasons.items()) or "no reason counted")
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(", ".join(fields(metrics) + [f"step {metrics.get('time/step_s', 0):.1f}s"]))
            return
        now = time.monotonic()
        pct_before, pct_now = (100 * (step - 1)) // self.total, (100 * step) // self.total
        crossed = pct_now // self.every_pct > pct_before // self.every_pct
        if not (crossed or step == self.total or now - self.last_line >= self.line_every_s):
            return
        self.last_line = now
        per_step = (now - self.started) / max(1, step - self.first)
        parts = fields(metrics) + [f"{per_step:.2f} s/step"]
        if step < self.total:
            parts.append(f"ETA {duration(per_step * (self.total - step))}")
        print(f"rl: step {step}/{self.total} ({pct_now}%): " + ", ".join(parts), file=self.stream, flush=True)

    def on_end(self, summary: dict) -> None:
        self.close()

    def on_interrupt(self, info: dict) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
