"""The controller's run state: where the loop is, and everything needed to continue it exactly.

`RunState.open` prepares the run directory (refusing another run's checkpoint, moving an old run
aside when told) and picks the checkpoint to resume (`trainer.resume=auto`: the newest complete
one, or a given path). `restore(collection)` then brings back every stateful part of the run from
it through one `Checkpointer` (`store/checkpoints.py`):

    (the run)      step, policy version, the run's identity and config: the state's top level
    data_cursor    the training split's stream (a task mixture's: every task's cursor, its sampler's state)
    collection     what the collection holds between steps (groups in flight or finished ahead)
    serving        the policy version the rollout side serves (a validation leaves it serving the new one)
    rng            the controller's Python / numpy / torch generators
    logs           metrics.jsonl, samples.jsonl, groups.jsonl: rows after the checkpoint are dropped
    (the model)    every training rank's model, optimizer, schedule and generators

`save_checkpoint` writes them all; `finish` exports the policy and writes the summary. `steps()` is
the loop's schedule: the steps after the checkpoint's, up to `trainer.total_steps`, unless the run's
hooks stop it earlier (`trainer.stop_after_dead_steps`).

The run's events (start, each logged step and validation, each complete checkpoint, an interrupt,
the end) reach its observers through `Hooks`: the console's progress, the learning-signal watch
(`controller/diagnosis.py`) and `trainer.callbacks` (`controller/callbacks.py`).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.controller import interrupts
from hybridrl.config.loader import to_dict
from hybridrl.controller.callbacks import Events
from hybridrl.controller.diagnosis import SignalWatch, diagnose
from hybridrl.controller.curriculum import training_stream
from hybridrl.controller.faults import Injector
from hybridrl.controller.efficiency import Efficiency
from hybridrl.controller.incidents import IncidentWatch, respond
from hybridrl.controller.link import Link
from hybridrl.controller.progress import Progress
from hybridrl.jobs import JobStopped, RunFailed
from hybridrl.data.mixture import MixtureStream
from hybridrl.data.stream import ShuffledStream
from hybridrl.store import rundir
from hybridrl.store.checkpoints import CheckpointManager, Checkpointer, capture_rng, restore_rng
from hybridrl.telemetry import live, otel, spans
from hybridrl.telemetry.metrics import MetricsLogger, read_metrics, truncate_after
from hybridrl.workers.faults import Faults
from hybridrl.workers.train_side import TrainSide

log = logging.getLogger(__name__)


class ControllerRng:
    """The controller's generators as a stateful part."""

    def state_dict(self) -> dict:
        return capture_rng()

    def load_state_dict(self, state: dict) -> None:
        restore_rng(state)


@dataclass
class RunLogs:
    """The run's JSON-lines logs: a resumed run drops the rows after its checkpoint's step (they are
    recomputed), so each step has one record (metrics.jsonl: `MetricsLogger(resume_from_step=...)`)."""

    run: "RunState"

    def state_dict(self) -> dict:
        return {"step": self.run.step}

    def load_state_dict(self, state: dict) -> None:
        step = state["step"]
        for name in ("samples.jsonl", "groups.jsonl"):
            truncate_after(Path(self.run.cfg.run.dir) / name, step)


class Serving(Link):
    """The placement's link (`collection.link`), remembering which policy version the rollout side
    serves; as a stateful part, a resume brings the rollout side back to it.

    A checkpoint taken after a validation has the rollout side serving the policy just trained, so the
    next step's switch publishes nothing. A resumed process starts with engines that serve the initial
    weights: without this its first step would publish (and probe) where the uninterrupted run did not.
    Restored, the version is published again before the first step (the same release: the ledger
    keeps the one it has), and the link goes back to training, as the checkpoint left it."""

    def __init__(self, link: Any, run: "RunState"):
        self.link, self.run = link, run
        self.version: int | None = None
        self.switched: tuple[int, dict] | None = None     # the last switch (its step, what it did)

    def to_rollout(self, version: int, step: int) -> dict:
        out = self.link.to_rollout(version, step)
        self.version = int(out.get("policy_version", version))
        self.switched = (step, out)
        return out

    def ensure_rollout(self, version: int, step: int) -> dict | None:
        out = self.link.ensure_rollout(version, step)
        self.version = version
        if out is not None:
            self.switched = (step, out)
        return out

    def to_train(self) -> dict:
        return self.link.to_train()

    def ensure_train(self) -> None:
        self.link.ensure_train()

    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        version = state.get("version")
        if version is not None and version == self.run.version:     # what the next switch would find served
            self.ensure_rollout(version, self.run.trained_at)
            self.link.ensure_train()


class Hooks:
    """What happens at the named moments of a run, outside the algorithm: faults due at a step's moment
    fire (job kinds) or are armed on the workers (worker kinds, before the phase they fire in); after
    the rollout, the kill switch (`hybridrl agent kill-switch RUN_DIR`) is read and, when set, the run
    stops without training on the step (`jobs.JobStopped`: resumable); and the run's observers hear
    its events (`controller/callbacks.py`)."""

    ARMS_BEFORE = {"switch": "rollout", "rollout": "train", "log": "checkpoint"}   # moment -> the phase armed after it

    def __init__(self, cfg: Any, wg: Any, run_dir: Path):
        self.cfg, self.wg = cfg, wg
        self.faults = Injector(cfg.trainer.inject, run_dir, checkpoint_every=cfg.trainer.checkpoint_every)
        self.run: Any = None
        tc = cfg.trainer
        self.watch = SignalWatch(group_baseline=not cfg.algo.uses_critic, total_steps=tc.total_steps,
                                 stop_after=tc.stop_after_dead_steps, fail_after=tc.stop_after_failed_steps)
        self.incidents = IncidentWatch(cfg.incidents)          # controller/incidents.py
        self.efficiency = Efficiency.of_run(cfg, wg)            # controller/efficiency.py
        self.events = Events.from_specs(tc.callbacks, builtin=[Progress(tc.total_steps), self.watch, self.incidents,
                                                               *live.observers(tc.metrics_host, tc.metrics_port)])
        self.tracer = otel.open_tracer(cfg)           # telemetry.traces (None when off)

    def at(self, step: int, moment: str) -> None:
        from hybridrl.agent import killswitch
        from hybridrl.workers.rank import RankWorker

        self.faults.at(step, moment)
        phase = self.ARMS_BEFORE.get(moment)
        if phase is not None:
            self.faults.arm(step, phase, lambda **fault: self.wg.call(Faults.arm_fault, **fault))
        if moment == "rollout" and killswitch.stop_requested(self.cfg, self.run, step,
                                                             lambda: self.wg.call(RankWorker.close)):
            raise JobStopped(f"stopped by the kill switch at step {step}")

    # the run's events
    def started(self, run: dict) -> None:
        self.events.emit("start", run)

    def logged(self, step: int, metrics: dict, trajectories: list | None = None) -> None:
        self.events.emit("step", step, dict(metrics))
        if self.tracer is not None and trajectories:
            self.tracer.step(step, metrics, trajectories)
        if "val/accuracy" in metrics:
            self.events.emit("validation", step, {k: v for k, v in metrics.items() if k.startswith("val/")})

    def checkpointed(self, step: int, path: Path) -> None:
        self.events.emit("checkpoint", step, str(path))

    def interrupted(self, info: dict) -> None:
        self.events.emit("interrupt", dict(info))

    def ended(self, summary: dict) -> None:
        self.events.emit("end", dict(summary))
        if self.tracer is not None:
            self.tracer.close()

    @property
    def stop_reason(self) -> str | None:
        """Why the run should end before trainer.total_steps (None: it goes on)."""
        return self.watch.stop_reason


@dataclass
class RunState:
    cfg: Any
    wg: Any
    step: int
    version: int
    stream: ShuffledStream | MixtureStream
    validation: list
    logger: MetricsLogger
    checkpoints: CheckpointManager
    tokenizer: Any
    hooks: Hooks
    identity: dict = field(default_factory=dict)      # task, model, shapes: what a checkpoint belongs to
    counters: dict = field(default_factory=dict)
    trained_at: int = 0                               # the step whose update made `version` (0: the start)
    source: Path | None = None                        # the checkpoint this run resumes from
    checkpointer: Checkpointer | None = None
    stopped: str | None = None                        # why the run ended before trainer.total_steps
    _ledger: Any = None

    @property
    def resumed_from(self) -> str | None:
        return str(self.source) if self.source is not None else None

    @property
    def ledger(self):
        """The run ledger (`hybridrl.store.ledger`), opened at its first use."""
        if self._ledger is None:
            from hybridrl.store.ledger import open_ledger

            self._ledger = open_ledger(self.cfg, self.tokenizer)
        return self._ledger

    @classmethod
    def open(cls, cfg, wg) -> "RunState":
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
        source = plan.checkpoint
        step = int(CheckpointManager.load_state(source)["step"]) if source is not None else 0
        if source is None or not (run_dir / "config.json").exists():
            (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
        if source is not None:
            log.info("%s", plan.note)
        run = cls(cfg=cfg, wg=wg, step=step, version=0,
                   stream=training_stream(cfg, task),        # the train split; task.mixture: a MixtureStream
                   validation=task.validation_split(),
                   logger=MetricsLogger(run_dir, resume_from_step=step if source is not None else None),
                   checkpoints=CheckpointManager(run_dir, keep=tc.keep_checkpoints),
                   tokenizer=AutoTokenizer.from_pretrained(cfg.model.path), hooks=Hooks(cfg, wg, run_dir),
                   identity=rundir.identity(cfg), source=source)
        run.hooks.run = run
        interrupts.on_controller(run.where, run.hooks.interrupted)     # SIGINT / SIGTERM: what to say, who to tell
        return run

    def restore(self, collection: Any) -> None:
        """Every stateful part from the checkpoint `open` chose (nothing without one); the collection's
        link becomes the run's `Serving` link."""
        wg = self.wg
        collection.link = serving = Serving(collection.link, self)
        self.checkpointer = Checkpointer(
            self.checkpoints, self,
            {"data_cursor": self.stream, "collection": collection, "serving": serving, "rng": ControllerRng(),
             "logs": RunLogs(self)},     # (the generators after the serving's publication)
            write_model=lambda d: wg.call(TrainSide.save_checkpoint, path=str(d),
                                          extra={"step": self.step, "policy_version": self.version}),
            read_model=lambda d: wg.call(TrainSide.load_checkpoint, path=str(d)))
        if self.source is not None:
            self.checkpointer.restore(self.source)
            log.info("resumed from %s: step %d, policy v%d", self.source, self.step, self.version)
        cfg = self.cfg
        self.hooks.started({"run_dir": cfg.run.dir, "name": cfg.run.name, "step": self.step,
                            "total_steps": cfg.trainer.total_steps, "resumed_from": self.resumed_from,
                            "config": to_dict(cfg), "earlier_metrics": read_metrics(cfg.run.dir)})

    def steps(self):
        """The steps left: after the checkpoint's step up to trainer.total_steps, unless the run's hooks
        ask it to stop (checked between steps, after the last one's checkpoint)."""
        try:
            while self.step < self.cfg.trainer.total_steps:     # (a rollback sets the step back)
                if self.hooks.watch.fail_reason is not None:
                    raise RunFailed(self.hooks.watch.fail_reason)
                reason = self.hooks.stop_reason
                if reason is not None:
                    self.stopped = reason
                    log.warning("stopping after step %d: %s", self.step, reason)
                    return
                spans.begin_step(self.step + 1)     # the run's timeline: a step lasts until the next one begins
                yield self.step + 1
        finally:
            spans.end_step()

    def where(self) -> dict:
        """Where the run is, for the line an interrupt prints: the last logged step, the newest checkpoint."""
        newest = self.checkpoints.latest()
        return {"step": self.step, "total_steps": self.cfg.trainer.total_steps,
                "checkpoint": str(newest) if newest is not None else None,
                "checkpoint_step": int(newest.name.rsplit("_", 1)[1]) if newest is not None else None}

    # a stateful part: the run's own cursor
    def state_dict(self) -> dict:
        return {"step": self.step, "policy_version": self.version, "trained_at": self.trained_at,
                "config": to_dict(self.cfg), "identity": self.identity}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.version = int(state["step"]), int(state["policy_version"])
        self.trained_at = int(state.get("trained_at", self.step if self.version else 0))   # older checkpoints

    def updated(self, step: int) -> None:
        """The update of `step` made the next policy version (what its publication says it comes from)."""
        self.version += 1
        self.trained_at = step

    def log(self, step: int, metrics: dict, samples: list | None = None) -> None:
        self.step = step
        self.logger.log(step, metrics)
        if samples and self.cfg.trainer.log_samples:
            self._write_samples(step, samples[: self.cfg.trainer.log_samples])
        self.hooks.logged(step, metrics, samples)

    def rolled_back(self, step: int, metrics: dict) -> bool:
        """The incident rules on the step's metrics so far (`controller/incidents.py`): a warning, a stop
        (raises `JobStopped`, resumable) or a rollback to the newest checkpoint (True: the loop goes on from
        there, the rest of this step skipped)."""
        return respond(self, self.hooks.incidents.check(step, metrics))

    def roll_back(self, checkpoint: Path, *, lr_scale: float = 1.0) -> dict | None:
        """Every stateful part back from `checkpoint` in this process, as a resume would bring it: the logs
        and the ledger drop the steps after it (they are done again); the learning rate times `lr_scale`
        (its value before and after, or None when unchanged)."""
        serving = self.checkpointer.parts["serving"]
        serving.ensure_train()
        self.checkpointer.restore(checkpoint)
        self.logger.close()
        self.logger = MetricsLogger(self.cfg.run.dir, resume_from_step=self.step)
        self.ledger.rewind(self.step + 1)
        step, switch = serving.switched or (0, {})
        release = switch.get("release")
        if release and int(release["policy_version"]) <= self.version:    # the rollout side still serves it
            self.ledger.record_switch(step, switch)                         # and will not publish it again
        log.info("rolled back to %s: step %d, policy v%d", checkpoint, self.step, self.version)
        return self.wg.call(TrainSide.scale_lr, factor=lr_scale) if lr_scale != 1 else None

    def stop_for_incident(self, step: int, reason: str) -> None:
        """Stop as Ctrl-C does (resumable from the newest checkpoint; `step` is not checkpointed)."""
        from hybridrl.workers.rank import RankWorker

        latest = self.checkpoints.latest()
        note = f"rl: stopped by {reason}; step {step} was not checkpointed. " + (
            f"The same command resumes from checkpoint {latest}" if latest else
            "There is no checkpoint to resume from: run again with trainer.resume=never")
        rundir.mark_finished(self.cfg.run.dir, self.step, status="stopped", stop_reason=reason,
                             checkpoint=str(latest) if latest else None)
        self.wg.call(RankWorker.close)
        self.logger.close()
        print(note, flush=True)
        raise JobStopped(note)

    @spans.traced("checkpoint")
    def save_checkpoint(self, step: int, link: Any) -> Path:
        link.ensure_train()
        started = time.perf_counter()
        path = self.checkpointer.save(step, before_complete=lambda: self.hooks.at(step, "checkpoint"))
        self.hooks.efficiency.checkpointed(time.perf_counter() - started)     # in the next step's metrics
        log.info("checkpoint step %d -> %s", step, path)
        self.hooks.checkpointed(step, path)
        return path

    def finish(self, wg) -> None:
        from hybridrl.workers.rank import RankWorker

        if self.cfg.trainer.export_hf:
            wg.call(TrainSide.export_hf, out_dir=str(Path(self.cfg.run.dir) / "hf"))
            if self.cfg.train.lora.rank:   # the adapters alone, for peft
                wg.call(TrainSide.export_peft, out_dir=str(Path(self.cfg.run.dir) / "hf_peft"))
        peak = [round(b / 2**20, 1) for b in wg.call(RankWorker.peak_rss_bytes)]
        wg.call(RankWorker.close)
        self.logger.close()
        summary = {**self.summary(), "peak_rss_mib": peak}
        rundir.mark_finished(self.cfg.run.dir, self.step, status="stopped" if self.stopped else "finished",
                             policy_version=self.version, validation=summary["validation"], peak_rss_mib=peak,
                             **({"stop_reason": self.stopped} if self.stopped else {}))
        self.hooks.ended(summary)
        print(format_summary(summary), flush=True)

    def summary(self) -> dict:
        """The whole run's outcome, read back from metrics.jsonl (a resumed run included)."""
        rows = read_metrics(self.cfg.run.dir)
        steps = [r for r in rows if r["step"] > 0]
        vals = [(r["step"], r["val/accuracy"]) for r in rows if r.get("val/accuracy") is not None]
        run_dir = Path(self.cfg.run.dir)
        dead = diagnose(steps, group_baseline=not self.cfg.algo.uses_critic)
        return {"steps": self.step, "total_steps": self.cfg.trainer.total_steps, "policy_version": self.version,
                "validation": vals, "trends": trends(steps),
                "steps_without_update": sum(1 for r in steps if r.get("train/updated") == 0.0),
                "seconds": sum(r.get("time/step_s") or 0.0 for r in steps),
                "validation_size": len(self.validation),
                "validation_temperature": self.cfg.trainer.validation_temperature,
                "diagnosis": dead.text if dead is not None else None, "stopped": self.stopped,
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


# (metrics key, what the summary calls it, how it is shown)
TRENDS = (("reward/mean", "reward", "{:.3f}"), ("train/entropy", "entropy", "{:.3f}"),
          ("episode/with_tool_call", "episodes calling a tool", "{:.1%}"))


def trends(steps: list[dict]) -> dict[str, tuple[float, float]]:
    """Each trend's first and last logged value over the training steps."""
    out = {}
    for key, _, _ in TRENDS:
        values = [r[key] for r in steps if r.get(key) is not None]
        if values:
            out[key] = (values[0], values[-1])
    return out


def format_summary(s: dict) -> str:
    """The end-of-run lines: steps, accuracy before and after, reward / entropy / tool use from the first
    step to the last, why the run learned nothing (when it did not), where the model and the logs are."""
    skipped = s["steps_without_update"]
    steps = f"rl: {s['steps']} step{'s' if s['steps'] != 1 else ''}"
    lines = [steps + (f" ({skipped} without an update: no trajectory admitted)" if skipped else "")
             + f", policy v{s['policy_version']}, {s['seconds']:.0f}s in steps"
             + (f"; resumed from {s['resumed_from']}" if s["resumed_from"] else "")]
    if s.get("stopped"):
        lines.append(f"rl: stopped at step {s['steps']} of {s['total_steps']}: {s['stopped']}")
    if s["validation"]:
        (first, before), (last, after) = s["validation"][0], s["validation"][-1]
        how = "greedy" if s["validation_temperature"] == 0 else f"temperature {s['validation_temperature']:g}"
        lines.append(f"rl: validation accuracy ({how}, {s['validation_size']} held-out instances): "
                     f"{100 * before:.1f}% at step {first} -> {100 * after:.1f}% at step {last} "
                     f"({100 * (after - before):+.1f} points)")
    shown = [f"{name} {fmt.format(s['trends'][key][0])} -> {fmt.format(s['trends'][key][1])}"
             for key, name, fmt in TRENDS if key in s.get("trends", {})]
    if shown:
        lines.append("rl: first step -> last: " + ", ".join(shown))
    if s.get("diagnosis") and not s.get("stopped"):
        lines.append(f"rl: {s['diagnosis']}")
    if s.get("peak_rss_mib"):
        lines.append("rl: peak resident memory per rank (MiB): " + ", ".join(f"{v:.0f}" for v in s["peak_rss_mib"]))
    where = f"rl: metrics {s['run_dir']}/metrics.jsonl, TensorBoard {s['run_dir']}/tensorboard"
    lines.append(where + (f"; HF model {s['model']}" if s["model"] else ""))
    return "\n".join(lines)
