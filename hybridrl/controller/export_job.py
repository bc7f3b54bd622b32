"""The ranks of `hybridrl export` (`hybridrl/cli/export.py`): each builds the run's actor, loads
the checkpoint named in $HYBRIDRL_EXPORT_CHECKPOINT into it and takes part in writing
$HYBRIDRL_EXPORT_OUT (rank 0 writes): the HF directory, or with $HYBRIDRL_EXPORT_FORMAT=peft the
LoRA adapters alone as a PEFT directory (`TrainEngine.export_peft`)."""

from __future__ import annotations

import os

from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.jobs import Job
from hybridrl.workers.base import Worker, register

FROM, TO = "HYBRIDRL_EXPORT_CHECKPOINT", "HYBRIDRL_EXPORT_OUT"     # what the job's ranks read
FORMAT = "HYBRIDRL_EXPORT_FORMAT"                                  # "hf" (the default) or "peft"


class ExportWorker(Worker):
    """A rank of the export: the run's actor, nothing else (no reference, critic or rollout engine)."""

    def __init__(self, cfg, ctx):
        super().__init__(ctx)
        from hybridrl.training import registry

        self.actor = registry.build(cfg, registry.ACTOR, ctx.device)

    def meshes(self):
        return {**super().meshes(), "train": self.actor.mesh}

    @register(dispatch=ONE_TO_ALL)
    def export(self, checkpoint: str, out_dir: str, form: str = "hf") -> dict:
        extra = self.actor.load_checkpoint(checkpoint)
        if form == "peft":
            self.actor.export_peft(out_dir)
        else:
            self.actor.export_hf(out_dir)
        return {"step": extra.get("step"), "policy_version": extra.get("policy_version")}


def run_export(cfg, wg) -> dict:
    return wg.call(ExportWorker.export, checkpoint=os.environ[FROM], out_dir=os.environ[TO],
                   form=os.environ.get(FORMAT, "hf"))[0]


JOB = Job("export", ExportWorker, run_export)
