"""A callback of a user's own (`trainer.callbacks=[tests.controller.recording_callback:Recorder]`): every
event it hears, as one JSON line in <run.dir>/events.jsonl.

With RECORDER_HOLD_AT_CHECKPOINT=N in its environment it also holds the run once it has heard of
checkpoint N: it writes <run.dir>/held and sleeps (up to two minutes, or until <run.dir>/release
exists), so that a test's signal or kill lands at a known moment (after step N, checkpoint N the
newest) however fast the machine runs the steps."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

_HOLD_S = 120.0


class Recorder:
    def __init__(self):
        self.path = None

    def _write(self, event: str, **data) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, **data}, default=str) + "\n")

    def on_start(self, run: dict) -> None:
        self.path = Path(run["run_dir"]) / "events.jsonl"
        self._write("start", step=run["step"], total_steps=run["total_steps"], resumed_from=run["resumed_from"],
                    total_steps_in_config=run["config"]["trainer"]["total_steps"])

    def on_step(self, step: int, metrics: dict) -> None:
        self._write("step", step=step, metrics=metrics)

    def on_validation(self, step: int, metrics: dict) -> None:
        self._write("validation", step=step, metrics=metrics)

    def on_checkpoint(self, step: int, path: str) -> None:
        self._write("checkpoint", step=step, path=path)
        if os.environ.get("RECORDER_HOLD_AT_CHECKPOINT") == str(step):
            (self.path.parent / "held").write_text(str(step))
            release = self.path.parent / "release"     # written by a test that lets the run go on
            deadline = time.monotonic() + _HOLD_S
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)                        # a signal's handler ends the process in here

    def on_interrupt(self, info: dict) -> None:
        self._write("interrupt", **info)

    def on_end(self, summary: dict) -> None:
        self._write("end", summary=summary)
