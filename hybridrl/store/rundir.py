"""A run directory that knows what it is, and what a launch may do with it.

    <run.dir>/run.json   the run: job, recipe and overrides, task (name, version, seed, options),
                         model (path, weight files), shapes (the model's dimensions, train.tp/pp),
                         status (running | finished | stopped | interrupted) and the last step

`plan(cfg)` decides, before any process starts (and again on rank 0 before anything is written):

    fresh       nothing of an earlier run is there
    resume      trainer.resume=auto: the newest complete checkpoint, when it was written by the same
                task, model and shapes and the run is not finished (or trainer.total_steps was
                raised past its end); trainer.resume=PATH: that checkpoint, as told
    move_aside  trainer.resume=never over an earlier run: it is renamed <run.dir>.old-N first; so is
                an interrupted run with nothing to resume from (SFT, or RL before its first
                checkpoint), and the run starts over

and raises `RunDirError` (one line: the difference, and how to go on) for an earlier run that
cannot continue: finished, without a checkpoint, or of another task, model or shapes. `hybridrl
train --overwrite` removes the earlier run's outputs first (`remove_outputs`). Import-light.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hybridrl.store.checkpoints import CheckpointManager
from hybridrl.telemetry.metrics import read_metrics

RECORD = "run.json"
# What runs write into run.dir (what --overwrite removes; nothing else in the directory is touched).
OUTPUTS = ("run.json", "config.json", "metrics.jsonl", "samples.jsonl", "tensorboard", "checkpoints", "hf",
           "offload", "envs.sqlite", "envs.sqlite-wal", "envs.sqlite-shm", "faults.jsonl", "interrupted.log",
           "wandb_run_id", "mlflow_run_id")
# What a start that died before its first step leaves and a fresh start would append to.
LEFTOVERS = ("run.json", "metrics.jsonl", "samples.jsonl", "tensorboard")
# config.json keys that fix the shapes of a checkpoint's tensors
SHAPE_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "vocab_size", "tie_word_embeddings")
FIX = "pass --overwrite to replace it, or trainer.resume=never to move it aside"

_origin: dict[str, Any] = {}


class RunDirError(Exception):
    """An earlier run in run.dir that this launch must not silently continue or overwrite."""


@dataclass
class Plan:
    action: str                          # fresh | resume | move_aside
    run_dir: Path
    checkpoint: Path | None = None
    note: str = ""                       # one line for the user, empty when there is nothing to say


def record_origin(recipe: str | None, overrides: Sequence[str]) -> None:
    """What launched this process (recorded in run.json): the recipe and the command-line overrides."""
    _origin.update(recipe=str(Path(recipe).resolve()) if recipe else None, overrides=list(overrides))


def origin() -> tuple[str | None, list[str]]:
    """The recipe (absolute) and command-line overrides this process was launched with."""
    return _origin.get("recipe"), list(_origin.get("overrides", []))


def identity(cfg) -> dict[str, Any]:
    """What a checkpoint of this run belongs to: task, model and shapes."""
    from hybridrl.envs.tasks.registry import task_class

    model = Path(cfg.model.path).resolve()
    config = json.loads((model / "config.json").read_text())
    weights = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(model.glob("*.safetensors"))}
    return {"task": {"name": cfg.task.name, "version": task_class(cfg.task.name).version, "seed": cfg.task.seed,
                     "options": dict(cfg.task.options)},
            "model": {"path": str(model), "weights": weights},
            "shapes": {**{k: config.get(k) for k in SHAPE_KEYS}, "train.tp": cfg.train.tp, "train.pp": cfg.train.pp}}


def differences(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two identities, one phrase each (`before` is the checkpoint's)."""
    out = []
    task = before.get("task", {})                # a checkpoint older than run.json records less
    for key in ("name", "version", "seed"):
        if key in task and task[key] != now["task"][key]:
            out.append(f"task.{key} was {task[key]!r}, is {now['task'][key]!r}")
    new = now["task"]["options"]
    old = task.get("options", new)
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            out.append(f"task.options.{key} was {old.get(key, '(default)')!r}, is {new.get(key, '(default)')!r}")
    model = before.get("model", {})
    if model.get("path", now["model"]["path"]) != now["model"]["path"]:
        out.append(f"model.path was {model['path']}, is {now['model']['path']}")
    elif model.get("weights", now["model"]["weights"]) != now["model"]["weights"]:
        out.append(f"the weights in model.path {now['model']['path']} were rewritten since")
    for key, value in now["shapes"].items():
        if before.get("shapes", {}).get(key, value) != value:
            out.append(f"{'' if key.startswith('train.') else 'model '}{key} was {before['shapes'][key]!r}, "
                       f"is {value!r}")
    return out


@dataclass
class _Earlier:
    steps: list[int]
    checkpoint: Path | None
    finished: bool
    record: dict[str, Any]

    def describe(self, job: str) -> str:
        state = "a finished" if self.finished else "an unfinished"
        steps = f"steps {self.steps[0]}-{self.steps[-1]}" if self.steps else "no steps logged"
        return f"{state} {self.record.get('job', job)} run ({steps})"


def _earlier(run_dir: Path) -> _Earlier | None:
    record = read_record(run_dir)
    steps = [row["step"] for row in read_metrics(run_dir)]
    checkpoint = CheckpointManager(run_dir).latest()
    finished = record.get("status") == "finished" or (not record and (run_dir / "hf" / "config.json").exists())
    if not steps and checkpoint is None and not finished:
        return None
    return _Earlier(steps, checkpoint, finished, record)


def plan(cfg) -> Plan:
    """What this launch does with run.dir; raises `RunDirError` when it must not go on."""
    run_dir, resume = Path(cfg.run.dir), cfg.trainer.resume
    if cfg.run.job == "rl" and resume not in ("auto", "never"):
        checkpoint = Path(resume)
        if not (checkpoint / "COMPLETE").exists():
            raise RunDirError(f"trainer.resume={resume}: not a complete checkpoint (no COMPLETE marker there)")
        diffs = differences(checkpoint_identity(checkpoint), identity(cfg))
        note = f"resuming {checkpoint} as trainer.resume says" + (f", although {'; '.join(diffs)}" if diffs else "")
        return Plan("resume", run_dir, checkpoint, note)
    earlier = _earlier(run_dir)
    if earlier is None:
        return Plan("fresh", run_dir)
    if resume == "never":
        check_model_outside(cfg, [run_dir], "trainer.resume=never moves the earlier run aside")
        return Plan("move_aside", run_dir, note=f"trainer.resume=never: the earlier run in {run_dir} moves to "
                                                f"{aside_path(run_dir)}")
    what = f"run.dir {run_dir} holds {earlier.describe(cfg.run.job)}"
    if earlier.record.get("status") == "interrupted" and (cfg.run.job != "rl" or earlier.checkpoint is None):
        check_model_outside(cfg, [run_dir], "the interrupted run there moves aside")
        return Plan("move_aside", run_dir, note=f"{what}, interrupted before it had a checkpoint to resume from: it "
                                                f"moves to {aside_path(run_dir)} and the run starts over")
    if cfg.run.job != "rl" or earlier.checkpoint is None:
        if cfg.run.job == "rl":
            what += " without a checkpoint to resume from"
        raise RunDirError(f"{what}; {FIX}, or set run.dir to a new directory")
    diffs = differences(checkpoint_identity(earlier.checkpoint), identity(cfg))
    if diffs:
        more = f" (and {len(diffs) - 1} more difference(s))" if len(diffs) > 1 else ""
        raise RunDirError(f"run.dir {run_dir} holds a checkpoint of another run ({earlier.checkpoint.name}): "
                          f"{diffs[0]}{more}; set run.dir to a new directory, or {FIX}")
    step = int(CheckpointManager.load_state(earlier.checkpoint)["step"])
    final = earlier.record.get("step", max([step, *earlier.steps]))
    if earlier.finished and final >= cfg.trainer.total_steps:
        raise RunDirError(f"run.dir {run_dir} holds a finished run (step {final} of trainer.total_steps="
                          f"{cfg.trainer.total_steps}); raise trainer.total_steps to continue it, {FIX}")
    note = f"resuming from {earlier.checkpoint} (step {step})"
    if earlier.steps and earlier.steps[-1] > step:
        note += f"; steps {step + 1}-{earlier.steps[-1]} run again"
    return Plan("resume", run_dir, earlier.checkpoint, note)


def prepare(cfg) -> Plan:
    """Rank 0, before anything is written: plan, move an earlier run aside if told, clear what a
    failed start left, and record the run in run.json."""
    p = plan(cfg)
    if p.action == "move_aside":
        aside = aside_path(p.run_dir)
        p.run_dir.rename(aside)
    elif p.action == "fresh":
        remove_outputs(p.run_dir, LEFTOVERS)   # a start that died before its first step: nothing to keep
    p.run_dir.mkdir(parents=True, exist_ok=True)
    record = read_record(p.run_dir) if p.action == "resume" else {}
    for key in ("signal", "checkpoint", "interrupted_at", "interrupted_at_s", "stop_reason"):
        record.pop(key, None)             # the earlier attempt's ending; this one is running
    record.update(job=cfg.run.job, **identity(cfg), status="running", hybridrl=_version(),
                  started_at=time.strftime("%Y-%m-%dT%H:%M:%S"), **{k: v for k, v in _origin.items()})
    write_record(p.run_dir, record)
    return p


def mark_finished(run_dir: str | Path, step: int, *, status: str = "finished", **summary: Any) -> None:
    """The run ended: `finished` (all its steps), or `stopped` before them (trainer.stop_after_dead_steps)."""
    record = read_record(Path(run_dir))
    record.update(status=status, step=step, finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"), **summary)
    write_record(Path(run_dir), record)


def mark_interrupted(run_dir: str | Path, step: int, *, signal: str, checkpoint: str | None) -> None:
    """SIGINT / SIGTERM stopped the run after `step`; `checkpoint` is the one the same command resumes from."""
    record = read_record(Path(run_dir))
    record.update(status="interrupted", step=step, signal=signal, checkpoint=checkpoint,
                  interrupted_at=time.strftime("%Y-%m-%dT%H:%M:%S"), interrupted_at_s=time.time())
    write_record(Path(run_dir), record)


def check_model_outside(cfg, paths: Sequence[Path], what: str) -> None:
    """Refuse when model.path lies inside one of `paths` (which are about to move or go)."""
    model = Path(cfg.model.path).resolve()
    for path in paths:
        if model == path.resolve() or path.resolve() in model.parents:
            raise RunDirError(f"model.path {cfg.model.path} is inside {path}, and {what}: keep the model outside "
                              "run.dir")


def remove_outputs(run_dir: str | Path, names: Sequence[str] = OUTPUTS) -> list[str]:
    """Delete what runs write into `run_dir` (`names`: OUTPUTS by default); anything else stays."""
    removed = []
    for name in names:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def aside_path(run_dir: Path) -> Path:
    n = 1
    while Path(f"{run_dir}.old-{n}").exists():
        n += 1
    return Path(f"{run_dir}.old-{n}")


def checkpoint_identity(checkpoint: Path) -> dict[str, Any]:
    state = CheckpointManager.load_state(checkpoint)
    if "identity" in state:
        return state["identity"]
    config = state.get("config", {})            # a checkpoint written before run.json existed
    return {"task": {"name": config.get("task", {}).get("name")},
            "model": {"path": str(Path(config.get("model", {}).get("path", "")).resolve())}}


def read_record(run_dir: Path) -> dict[str, Any]:
    path = run_dir / RECORD
    return json.loads(path.read_text()) if path.exists() else {}


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    tmp = run_dir / (RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, run_dir / RECORD)


def _version() -> str:
    from hybridrl import __version__

    return __version__
