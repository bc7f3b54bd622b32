"""Which models an evaluation runs on: an HF directory, or the checkpoints of a run.

    --model DIR                     an HF model directory; a run directory means its exported hf/
    --run RUN_DIR [--checkpoints all|last|N,M]
        step 0          the run's starting model (its model.path)
        step N          a complete checkpoint (checkpoints/step_N): its distributed checkpoint is
                        exported once to RUN_DIR/eval/models/step_N (a short job on the run's
                        train.tp * train.pp ranks, `run.job=hybridrl.evaluate.export:JOB`), unless
                        it is the run's last step and the run exported hf/ (the same weights)
        all             step 0, every complete checkpoint and the final export; last: the newest

Results go to RUN_DIR/eval/<suite>/step_NNNNNN.json for a run's models; an HF directory outside any
run writes to ./eval/<suite>/model-<name>.json unless --out says where.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.distributed.process_exit import torchrun_command

EXPORT_PLAN_ENV = "HYBRIDRL_EXPORT_PLAN"


@dataclass
class Candidate:
    """One model to evaluate."""

    label: str                  # the result's file name (without .json)
    path: Path | None           # its HF directory (None: a checkpoint not exported yet)
    step: int | None
    run_dir: Path | None = None
    checkpoint: Path | None = None
    what: str = ""

    def info(self) -> dict[str, Any]:
        return {"label": self.label, "step": self.step, "run": str(self.run_dir) if self.run_dir else None,
                "checkpoint": str(self.checkpoint) if self.checkpoint else None, "what": self.what}


def step_label(step: int) -> str:
    return f"step_{step:06d}"


def _is_run(path: Path) -> bool:
    return (path / "run.json").exists()


def from_model(model: str | Path) -> Candidate:
    """`--model`: an HF directory (a run directory, or a run's hf/, means that run's final model)."""
    path = Path(model)
    if _is_run(path) and (path / "hf" / "config.json").exists():
        path = path / "hf"
    run = path.parent if path.name == "hf" and _is_run(path.parent) else None
    if run is not None:
        record = json.loads((run / "run.json").read_text())
        step = int(record.get("step") or 0)
        if record.get("job") == "rl" and record.get("status") == "finished":
            return Candidate(step_label(step), path, step, run, what="the run's final export (hf/)")
        return Candidate(f"{record.get('job', 'run')}-hf", path, None, run, what=f"the {record.get('job')} run's hf/")
    return Candidate(f"model-{path.resolve().name}", path, None, what="an HF model directory")


def run_config(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())


def from_run(run_dir: str | Path, which: str = "all") -> list[Candidate]:
    """The models of a run that `--checkpoints` selects, oldest first."""
    from hybridrl.store.checkpoints import CheckpointManager

    run = Path(run_dir)
    if not _is_run(run):
        raise FileNotFoundError(f"{run} is not a run directory (no run.json / config.json): pass run.dir of an RL run")
    record = json.loads((run / "run.json").read_text())
    config = run_config(run)
    found: dict[int, Candidate] = {0: Candidate(step_label(0), Path(config["model"]["path"]), 0, run,
                                                what="the run's starting model (model.path)")}
    for ckpt in CheckpointManager(run).complete():
        step = int(ckpt.name.rsplit("_", 1)[1])
        exported = run / "eval" / "models" / step_label(step)
        found[step] = Candidate(step_label(step), exported if (exported / "COMPLETE").exists() else None, step, run,
                                checkpoint=ckpt, what=f"checkpoint {ckpt.name}")
    if record.get("status") == "finished" and (run / "hf" / "config.json").exists():
        step = int(record.get("step") or 0)        # the same weights as a checkpoint of that step
        found[step] = Candidate(step_label(step), run / "hf", step, run, what="the run's final export (hf/)")
    steps = sorted(found)
    if which == "all":
        chosen = steps
    elif which == "last":
        chosen = steps[-1:]
    else:
        try:
            chosen = [int(s) for s in which.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"--checkpoints {which!r}: write all, last, or steps as N,M") from None
        missing = [s for s in chosen if s not in found]
        if missing:
            raise ValueError(f"--checkpoints: no model of step {missing[0]} in {run} (it has steps {steps}: step 0 is "
                             "the starting model, the others its complete checkpoints and final export)")
    return [found[s] for s in chosen]


def export_missing(run_dir: Path, candidates: list[Candidate]) -> None:
    """Export the checkpoints among `candidates` that have no HF directory yet: one job on the run's
    train.tp * train.pp ranks converts all of them."""
    pending = [c for c in candidates if c.path is None]
    if not pending:
        return
    config = run_config(run_dir)
    plan = run_dir / "eval" / "models" / "plan.json"
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_text(json.dumps([{"checkpoint": str(c.checkpoint / "model"),
                                 "out": str(run_dir / "eval" / "models" / c.label)} for c in pending]))
    nproc = int(config["train"]["tp"]) * int(config["train"]["pp"])
    cmd = torchrun_command(nproc, "-m", "hybridrl.train", "--config", str(run_dir / "config.json"),
                           "run.job=hybridrl.evaluate.export:JOB", f"distributed.nproc_per_node={nproc}",
                           "placement.mode=colocated", "trainer.inject=[]")
    print(f"hybridrl eval: exporting {len(pending)} checkpoint(s) of {run_dir} to HF on {nproc} rank(s)",
          file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, env={**os.environ, EXPORT_PLAN_ENV: str(plan)}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"exporting the checkpoints failed (exit {proc.returncode}): {proc.stdout[-2000:]}")
    for c in pending:
        c.path = run_dir / "eval" / "models" / c.label
        if not (c.path / "COMPLETE").exists():
            raise RuntimeError(f"the export of {c.checkpoint} wrote no {c.path}/COMPLETE")
