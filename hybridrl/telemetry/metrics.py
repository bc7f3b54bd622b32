"""Per-step metrics: TensorBoard scalars + `metrics.jsonl` in the run directory + a console line.

One call per step, `log(step, metrics)`, writes the same keys to all sinks; validation keys use
the `val/` prefix. Values must be numbers (NaN is written as null in JSON). Steps only go
forward: `metrics.jsonl` never holds two rows for one step. A new logger refuses a file that
already holds rows unless it resumes (`resume_from_step`: the rows after that step are dropped).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping

def _clean(value) -> float | None:
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, resume_from_step: int | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if resume_from_step is not None:
            self._truncate_after(resume_from_step)
        steps = [row["step"] for row in read_metrics(self.dir)]
        if steps and resume_from_step is None:
            raise FileExistsError(f"{self.path} already holds steps {steps[0]}-{steps[-1]} of an earlier run; "
                                  "resume it or start in a clean run directory")
        self.last_step = steps[-1] if steps else None
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir / "tensorboard"),
                                         purge_step=resume_from_step + 1 if resume_from_step is not None else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"{self.path}: step {step} logged after step {self.last_step} (one row per step)")
        self.last_step = step
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._writer is not None:
            for key, value in row.items():
                if key != "step" and value is not None:
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _truncate_after(self, step: int) -> None:
        truncate_after(self.path, step)


def truncate_after(path: Path, step: int) -> None:
    """On resume, drop the rows of a JSON-lines log (each with a "step") after the checkpoint's
    step: they will be recomputed."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")      # replaced at once: a kill meanwhile loses no row
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
