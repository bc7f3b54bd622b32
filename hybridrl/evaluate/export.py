"""A run's distributed checkpoints as HF directories, for evaluation (`run.job=hybridrl.evaluate.export:JOB`).

Every rank builds the run's training engine frozen (the architecture of its model.path, at its
train.tp / train.pp), and for each (checkpoint, out) pair of the plan (a JSON file named by
$HYBRIDRL_EXPORT_PLAN, written by `hybridrl eval --run`) loads the checkpoint's model weights
(nothing of its optimizer) and exports them, the way a finished run exports hf/. `out/COMPLETE` is
written last: an interrupted export is done again, never used.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.jobs import Job
from hybridrl.workers.base import Worker, register


class ExportWorker(Worker):
    def __init__(self, cfg, ctx):
        super().__init__(ctx)
        from hybridrl.training.registry import REFERENCE, build

        self.engine = build(cfg, REFERENCE, ctx.device)

    def meshes(self):
        return {**super().meshes(), "train": self.engine.mesh}

    @register(dispatch=ONE_TO_ALL)
    def export(self, checkpoint: str, out: str) -> None:
        self.engine.load_checkpoint(checkpoint)
        self.engine.export_hf(out)


def export_plan(cfg, wg) -> list[str]:
    from hybridrl.evaluate.models import EXPORT_PLAN_ENV

    plan = json.loads(Path(os.environ[EXPORT_PLAN_ENV]).read_text())
    done = []
    for item in plan:
        out = Path(item["out"])
        (out / "COMPLETE").unlink(missing_ok=True)
        wg.call(ExportWorker.export, checkpoint=item["checkpoint"], out=str(out))
        (out / "COMPLETE").write_text("")
        done.append(str(out))
    return done


JOB = Job("export", ExportWorker, export_plan)
