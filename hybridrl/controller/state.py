"""The controller's run state: where the loop is, and everything needed to continue it exactly.

`RunState.start` resumes from the newest complete checkpoint when `trainer.resume=auto` (or a
given path), restoring the model/optimizer/RNG of every rank, the policy version, the data
cursor, the controller's RNG and the metrics log (rows after the checkpoint are dropped);
otherwise it starts fresh. `save_checkpoint` writes all of that; `finish` exports the policy.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.config.loader import to_dict
from hybridrl.controller import rundir
from hybridrl.controller.faults import Injector
from hybridrl.data.stream import Cursor, ShuffledStream
from hybridrl.store.checkpoints import CheckpointManager, capture_rng, restore_rng
from hybridrl.telemetry.metrics import MetricsLogger, read_metrics, truncate_after
from hybridrl.workers.hybrid import HybridWorker

log = logging.getLogger(__name__)


@dataclass
class RunState:
    cfg: Any
    step: int
    version: int
    stream: ShuffledStream
    validation: list
    logger: MetricsLogger
    checkpoints: CheckpointManager
    tokenizer: Any
    identity: dict = field(default_factory=dict)      # task, model, shapes: what a checkpoint belongs to
    counters: dict = field(default_factory=dict)
    collection: dict = field(default_factory=dict)    # partial rollouts: prompts in flight (see collection.py)
    resumed_from: str | None = None
    faults: Injector | None = None
    _ledger: Any = None

    @property
    def ledger(self):
        """The run ledger (`hybridrl.store.ledger`), opened at its first use."""
        if self._ledger is None:
            from hybridrl.store.ledger import open_ledger

            self._ledger = open_ledger(self.cfg, self.tokenizer)
        return self._ledger

    @classmethod
    def start(cls, cfg, wg) -> "RunState":
        from transformers import AutoTokenizer

        from hybridrl.envs.tasks import get_task

        task = get_task(cfg.task.name, cfg.task)
        tc = cfg.trainer
        run_dir = Path(cfg.run.dir)
        rollout_dp = wg.mesh("rollout").dp_size
        if tc.prompts_per_step % rollout_dp:
            raise ValueError(f"trainer.prompts_per_step={tc.prompts_per_step} must be a multiple of the rollout "
                             f"data-parallel size ({rollout_dp}) so that every group stays on one engine")
        fired = run_dir / "faults.jsonl"    # injected faults fire once, even if the run starts over
        fired_before = fired.read_text() if fired.exists() else None
        plan = rundir.prepare(cfg)       # refuses another run's checkpoint; moves an old run aside if told
        if fired_before is not None and not fired.exists():
            fired.write_text(fired_before)
        if plan.note and plan.action != "resume":
            log.info("%s", plan.note)
        checkpoints = CheckpointManager(run_dir, keep=tc.keep_checkpoints)
        source = plan.checkpoint
        step, version, cursor, collection = 0, 0, Cursor(), {}
        if source is not None:
            state = CheckpointManager.load_state(source)
            wg.call(HybridWorker.load_checkpoint, path=str(source / "model"))
            step, version = state["step"], state["policy_version"]
            cursor = Cursor(**state["data_cursor"])
            collection = state.get("collection", {})
            restore_rng(state["rng"])
            truncate_after(run_dir / "samples.jsonl", step)     # as metrics.jsonl: one step, one record
            truncate_after(run_dir / "groups.jsonl", step)
            log.info("%s: policy v%d", plan.note, version)
        if source is None or not (run_dir / "config.json").exists():
            (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        return cls(cfg=cfg, step=step, version=version,
                   stream=ShuffledStream(task.train_split(), seed=cfg.run.seed, cursor=cursor),
                   validation=task.validation_split(),
                   logger=MetricsLogger(run_dir, resume_from_step=step if source is not None else None),
                   checkpoints=checkpoints, tokenizer=tokenizer, identity=rundir.identity(cfg),
                   resumed_from=str(source) if source is not None else None,
                   faults=Injector(tc.inject, run_dir, checkpoint_every=tc.checkpoint_every),
                   collection=collection)

    def log(self, step: int, metrics: dict, samples: list | None = None) -> None:
        self.step = step
        self.logger.log(step, metrics)
        if samples and self.cfg.trainer.log_samples:
            self._write_samples(step, samples[: self.cfg.trainer.log_samples])

    def arm_faults(self, wg, step: int, moment: str) -> None:
        """The worker-side faults due at (step, moment), armed on the workers (`controller/faults.py`)."""
        self.faults.arm(step, moment, lambda **fault: wg.call(HybridWorker.arm_fault, **fault))

    def save_checkpoint(self, wg, step: int) -> Path:
        if wg.call(HybridWorker.mode) != "train":
            wg.call(HybridWorker.enter_train)
        self.arm_faults(wg, step, "checkpoint")
        state = {"policy_version": self.version, "data_cursor": self.stream.state(), "rng": capture_rng(),
                 "collection": self.collection,
                 "config": to_dict(self.cfg), "identity": self.identity}
        path = self.checkpoints.save(step, state, lambda model_dir: wg.call(
            HybridWorker.save_checkpoint, path=str(model_dir), extra={"step": step, "policy_version": self.version}),
            before_complete=lambda: self.faults.at(step, "checkpoint"))
        log.info("checkpoint step %d -> %s", step, path)
        return path

    def finish(self, wg) -> None:
        if self.cfg.trainer.export_hf:
            wg.call(HybridWorker.export_hf, out_dir=str(Path(self.cfg.run.dir) / "hf"))
        wg.call(HybridWorker.close)
        self.logger.close()
        summary = self.summary()
        rundir.mark_finished(self.cfg.run.dir, self.step, policy_version=self.version,
                             validation=summary["validation"])
        print(format_summary(summary), flush=True)

    def summary(self) -> dict:
        """The whole run's outcome, read back from metrics.jsonl (a resumed run included)."""
        rows = read_metrics(self.cfg.run.dir)
        steps = [r for r in rows if r["step"] > 0]
        vals = [(r["step"], r["val/accuracy"]) for r in rows if r.get("val/accuracy") is not None]
        run_dir = Path(self.cfg.run.dir)
        return {"steps": self.step, "policy_version": self.version, "validation": vals,
                "steps_without_update": sum(1 for r in steps if r.get("train/updated") == 0.0),
                "seconds": sum(r.get("time/step_s") or 0.0 for r in steps),
                "validation_size": len(self.validation),
                "validation_temperature": self.cfg.trainer.validation_temperature,
                "run_dir": str(run_dir), "resumed_from": self.resumed_from,
                "model": str(run_dir / "hf") if self.cfg.trainer.export_hf else None}

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    def _write_samples(self, step: int, trajectories: list) -> None:
        with (Path(self.cfg.run.dir) / "samples.jsonl").open("a") as f:
            for t in trajectories:
                f.write(json.dumps({"step": step, "trajectory_id": t.trajectory_id, "status": t.status.value,
                                    "reward": t.reward, "text": self.tokenizer.decode(t.prompt_ids + t.response_ids)})
                        + "\n")


def format_summary(s: dict) -> str:
    """The end-of-run lines: steps, accuracy before and after, where the model and the logs are."""
    skipped = s["steps_without_update"]
    steps = f"rl: {s['steps']} step{'s' if s['steps'] != 1 else ''}"
    lines = [steps + (f" ({skipped} without an update: no trajectory admitted)" if skipped else "")
             + f", policy v{s['policy_version']}, {s['seconds']:.0f}s in steps"
             + (f"; resumed from {s['resumed_from']}" if s["resumed_from"] else "")]
    if s["validation"]:
        (first, before), (last, after) = s["validation"][0], s["validation"][-1]
        how = "greedy" if s["validation_temperature"] == 0 else f"temperature {s['validation_temperature']:g}"
        lines.append(f"rl: validation accuracy ({how}, {s['validation_size']} held-out instances): "
                     f"{100 * before:.1f}% at step {first} -> {100 * after:.1f}% at step {last} "
                     f"({100 * (after - before):+.1f} points)")
    where = f"rl: metrics {s['run_dir']}/metrics.jsonl, TensorBoard {s['run_dir']}/tensorboard"
    lines.append(where + (f"; HF model {s['model']}" if s["model"] else ""))
    return "\n".join(lines)
