"""Fault injection into a real run: `trainer.inject` (or `hybridrl train RECIPE --inject SPEC`).

    SPEC = KIND@STEP[:MOMENT]          e.g. kill_job@3:train, kill_rank@2:rollout, engine@2, nan@3

Kinds (each ends one of two documented ways; docs/running.md "Faults and resume"): the step goes on with the
affected trajectories infrastructure-invalid (counted, never trained on), or the run stops and
resumes from its newest complete checkpoint (by itself with `trainer.max_restarts > 0`).
- `kill_job`: SIGKILL the whole job at that moment: the torchrun agent (what `hybridrl train`
  became), every rank and their children (tool sandboxes, checkpoint writers). Nothing can run
  a handler. The run resumes from its newest complete checkpoint when started again.
- `kill_rank`: SIGKILL the last worker rank (`kill_rank1`...: that rank) at that moment. The
  controller sees the rank die and the run exits with code 1; with `trainer.max_restarts > 0`
  torchrun restarts every rank and the run resumes from its newest complete checkpoint.
Faults armed on a worker at the start of the step's rollout (the last rank with an engine), each
firing once, at its first chance from then on:
- `engine`: the rollout engine's next forward step fails, as a crashed engine does: every request
  in flight fails, their episodes end infrastructure-invalid; the engine serves the rest.
- `tool`: the next tool call's backend fails (as a killed sandbox does): that episode ends
  infrastructure-invalid. A step whose episodes call no tool leaves it armed for the next.
- `reward`: the task's verifier raises on the next episode it scores (an evaluator error): that
  episode is infrastructure-invalid.
- `env_kill`: the environment service SIGKILLs its process right after committing a step, before
  replying (a task with an environment): the run stops; resumed, the committed action is answered
  from the record, never executed again.
Armed on the last rank before the step's checkpoint (the step must write one):
- `disk_full`: writing the checkpoint fails with ENOSPC: the run stops naming it, the incomplete
  checkpoint is never used, and the run resumes from the one before.
Armed on the last training rank after the step's rollout, for its update (they exercise the run's
incident rules, `controller/incidents.py`, whose actions decide what follows):
- `nan`: the update's loss is NaN on that rank; the reduced gradients and then every weight become
  NaN, as a real blow-up leaves them (the `nan` rule: stop by default).
- `mismatch`: the update's behaviour logprobs on that rank arrive 1 nat below what the engine
  returned, a rollout/trainer mismatch spike (the `mismatch` rule: warn by default).

Moments, in the order a step passes them (the default is `rollout`):
  switch      the workers switched to rollout mode; no episode ran yet
  rollout     the step's episodes ran (and, for a stateful task, their environment steps were
              committed); nothing trained on them yet
  train       the update ran: weights and optimizer changed in memory; nothing logged
  log         the step's metrics are written; its checkpoint (if one is due) is not
  checkpoint  inside the step's checkpoint: the model is written, the COMPLETE marker is not
              (the step must check-point on this step, i.e. STEP % trainer.checkpoint_every == 0)

A fault fires once per run directory: `<run.dir>/faults.jsonl` records it before it fires, so a
restarted or resumed run passes the same moment again without dying again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hybridrl.workers.fault_kinds import JOB, KINDS as FAULT_KINDS

log = logging.getLogger(__name__)

KINDS = tuple(FAULT_KINDS)
WORKER_KINDS = tuple(k.name for k in FAULT_KINDS.values() if k.fired_by != JOB)   # armed on a worker, fired there
MOMENTS = ("switch", "rollout", "train", "log", "checkpoint")
_SPEC = re.compile(r"^(?P<kind>kill_rank(?P<rank>\d+)?|" + "|".join(k for k in KINDS if k != "kill_rank")
                   + r")@(?P<step>\d+)(?::(?P<moment>\w+))?$")


@dataclass(frozen=True)
class Fault:
    spec: str
    kind: str
    step: int
    moment: str
    rank: int | None = None          # kill_rank: which rank (None: the last one)


def parse(spec: str) -> Fault:
    m = _SPEC.match(spec.strip())
    if m is None:
        raise ValueError(f"fault {spec!r}: expected KIND@STEP[:MOMENT] with KIND one of {', '.join(KINDS)} "
                         f"(kill_rankN for rank N), e.g. kill_job@3:train")
    kind = "kill_rank" if m["kind"].startswith("kill_rank") else m["kind"]
    natural = FAULT_KINDS[kind].moment or "rollout"
    moment = m["moment"] or natural
    if kind in WORKER_KINDS and moment != natural:
        raise ValueError(f"fault {spec!r}: {kind} fires during the step's {natural}; leave the moment out")
    if moment not in MOMENTS:
        raise ValueError(f"fault {spec!r}: unknown moment {moment!r}; one of {', '.join(MOMENTS)}")
    if int(m["step"]) < 1:
        raise ValueError(f"fault {spec!r}: steps count from 1")
    return Fault(spec.strip(), kind, int(m["step"]), moment, int(m["rank"]) if m["rank"] else None)


def check(specs: Sequence[str], *, checkpoint_every: int, world_size: int | None = None) -> list[Fault]:
    """Parse and check every spec against the run's schedule (before any process starts)."""
    faults = [parse(s) for s in specs]
    for f in faults:
        if f.moment == "checkpoint" and (not checkpoint_every or f.step % checkpoint_every):
            raise ValueError(f"fault {f.spec!r}: step {f.step} writes no checkpoint (trainer.checkpoint_every="
                             f"{checkpoint_every}); pick a step that does or another moment")
        if f.kind == "kill_rank" and f.rank == 0:
            raise ValueError(f"fault {f.spec!r}: rank 0 is the controller; kill_job kills it with the rest")
        if f.kind == "kill_rank" and world_size is not None and f.rank is not None and f.rank >= world_size:
            raise ValueError(f"fault {f.spec!r}: there is no rank {f.rank} in a world of {world_size}")
    return faults


class Injector:
    """Rank 0's view of the run's faults; `at(step, moment)` fires the ones due there, `arm(step,
    moment, call)` hands the worker-side ones due there to `call(kind, spec)` (a worker-group call)."""

    def __init__(self, specs: Sequence[str], run_dir: str | Path, *, checkpoint_every: int = 0):
        self.faults = check(specs, checkpoint_every=checkpoint_every)
        self.record = Path(run_dir) / "faults.jsonl"

    def arm(self, step: int, moment: str, call) -> None:
        """Worker-side faults due at (step, moment): recorded first (each fires once per run directory),
        then armed on the workers."""
        for fault in self._due(step, moment, worker=True):
            log.warning("fault injection: arming %s (step %d)", fault.spec, step)
            call(kind=fault.kind, spec=fault.spec)

    def fired(self) -> set[str]:
        if not self.record.exists():
            return set()
        return {json.loads(line)["spec"] for line in self.record.read_text().splitlines() if line.strip()}

    def at(self, step: int, moment: str) -> None:
        for fault in self._due(step, moment, worker=False):
            log.warning("fault injection: %s (step %d, %s)", fault.spec, step, moment)
            if fault.kind == "kill_job":
                kill_job()
            else:
                kill_rank(fault.rank)

    def _due(self, step: int, moment: str, *, worker: bool) -> list[Fault]:
        """The faults of this kind due at (step, moment) that have not fired, each recorded (fsynced)
        before it is returned, so a restarted or resumed run does not fire it again."""
        due = [f for f in self.faults if f.step == step and f.moment == moment and (f.kind in WORKER_KINDS) == worker]
        if not due:
            return []
        fired = self.fired()
        out = []
        for fault in due:
            if fault.spec in fired:
                continue
            with self.record.open("a") as f:        # first the record, so a restart does not fire it again
                f.write(json.dumps({"spec": fault.spec, "step": step, "moment": moment, "pid": os.getpid()}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            out.append(fault)
        return out


def _job_processes():
    """(agent, ranks): the torchrun agent this rank runs under and its worker processes."""
    import psutil

    me = psutil.Process()
    agent = me.parent()
    ranks = [p for p in agent.children() if p.pid != me.pid] + [me]
    return agent, ranks


def kill_job() -> None:
    """SIGKILL the agent, every rank and everything they started; this process last."""
    import psutil

    agent, _ = _job_processes()
    me = psutil.Process()
    everyone = [p for p in agent.children(recursive=True) if p.pid != me.pid]
    for p in [agent, *everyone]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def kill_rank(rank: int | None) -> None:
    """SIGKILL one worker rank (by its RANK environment variable; None: the highest)."""
    import psutil

    _, ranks = _job_processes()
    by_rank = {}
    for p in ranks:
        try:
            by_rank[int(p.environ().get("RANK", "-1"))] = p
        except (psutil.Error, ValueError):
            continue
    target = max(by_rank) if rank is None else rank
    if target not in by_rank or target == 0:
        raise RuntimeError(f"fault injection: no worker rank {target} among {sorted(by_rank)}")
    by_rank[target].send_signal(signal.SIGKILL)
