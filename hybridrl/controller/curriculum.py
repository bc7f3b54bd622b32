"""The curriculum on the controller: the run's training stream, and each task's share of what a step trains on.

`training_stream(cfg, task)` is the stream collections draw from: a `ShuffledStream` over the task's
train split, or, with `task.name=mixture`, a `MixtureStream` (`hybridrl/data/mixture.py`) over each
task's split with the configured sampler.

`after_rollout(collection, step, trajectories, metrics)`, at the end of every collection's
rollout, feeds the stream what happened (prompt success rates of the scored episodes for the
difficulty sampler, per-task statistics of what was collected: `task/<name>/*`) and, in partial
rollouts, keeps each task's share of the groups the step trains on (`task.share_policy`). A quota
counts the groups the update will admit (`algo.filters.admit`: not the infra-invalid, aborted, too
stale or all-equal ones); a group the update will drop passes through uncounted (its reason is
counted in `filter/*`), so a share is of trained groups, not of collected ones:

    wait     the step takes each task's share of `quorum` groups (by weight, largest remainders). A
             task with more complete groups than its share has the extra ones held for the next step
             (`share/held_groups`); for a task with fewer, the step waits: it collects again (new
             groups of that task are launched when none is in flight) until the share is there or
             `task.share_max_wait_rounds` rounds have passed (then it trains short, counted in
             `share/short_groups`). `share/wait_rounds`, `share/wait_s` count what waiting cost.
    launch   the same holding, no waiting: the stream launches more of a slow task (weights scaled by
             each task's latency in steps), so that its groups come back at its share's rate.
    none     the step trains what completed (with environments of different speeds, the fast task's
             groups come first): only counted.

Every step reports, after admission (`after_admission`, called by the trainer on the admitted
trajectories), `share/<task>` (its trained groups' fraction of the step) and `share/outside_tolerance`
(1 when a task's cumulative share of trained groups is further from its weight than
`task.share_tolerance` of it).
A synchronous step runs all the groups it drew (the weights); its shares of trained groups differ
from those by what admission drops (a task whose prompts are always or never solved trains less).
Held groups go into the stream's checkpoint state as instances: a resumed run launches them again,
first.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from hybridrl.algo.filters import admit
from hybridrl.data.mixture import MixtureStream
from hybridrl.data.stream import ShuffledStream
from hybridrl.envs.tasks.mixture import shares


def training_stream(cfg: Any, task: Any) -> ShuffledStream | MixtureStream:
    if not cfg.task.mixture:
        return ShuffledStream(task.train_split(), seed=cfg.run.seed)
    tc = cfg.task
    return MixtureStream({name: t.train_split() for name, t in task.tasks.items()}, task.weights, seed=cfg.run.seed,
                         sampler=tc.sampler, floor=tc.sampler_floor, window=tc.sampler_window,
                         share_policy=tc.share_policy)


def after_rollout(collection: Any, step: int, trajectories: list, metrics: dict, *,
                  partial: bool = False) -> tuple[list, dict]:
    """What every collection's rollout ends with (see the module doc); returns (trajectories, metrics).
    `partial`: a partial-rollout collection, whose steps take what completed (the share is kept here)."""
    stream = collection.run.stream
    if not isinstance(stream, MixtureStream):
        return trajectories, metrics
    if partial:
        trajectories, counts = keep_shares(collection, step, trajectories)
        metrics.update(counts)
    stream.observe(trajectories, step)
    metrics.update(stream.step_metrics(trajectories))
    return trajectories, metrics


def after_admission(cfg: Any, stream: Any, kept: list) -> dict[str, float]:
    """The step's shares of trained groups (`share_metrics` over the admitted trajectories `kept`);
    {} for a run without a mixture."""
    if not isinstance(stream, MixtureStream):
        return {}
    return share_metrics(stream, kept, cfg.task.share_tolerance)


def trains(cfg: Any, members: list, version: int) -> bool:
    """Whether the update at `version` would admit any member of a group (the trainer's admission)."""
    return bool(admit(members, cfg.algo, current_version=version,
                      max_response_tokens=cfg.agent.max_response_tokens).kept)


def _by_group(trajectories: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in trajectories:
        out.setdefault(t.group_id, []).append(t)
    return out


def keep_shares(collection: Any, step: int, trajectories: list) -> tuple[list, dict[str, float]]:
    """The step's groups, each task at its share of the quorum (held / waited for per `task.share_policy`)."""
    stream: MixtureStream = collection.run.stream
    policy = collection.cfg.task.share_policy
    counts = {"share/held_groups": 0.0, "share/wait_rounds": 0.0, "share/wait_s": 0.0, "share/short_groups": 0.0,
              "share/launched_for_share": 0.0}
    returned = collection.returned_instances
    pool: list[tuple[dict, list]] = list(stream.held)                 # held from earlier steps: oldest first
    pool += [(returned.get(g, {}), members) for g, members in _by_group(trajectories).items()]
    if policy == "none":
        stream.held = []
        _set_pipeline(collection, stream, [])
        return [t for _, m in pool for t in m], counts
    quota = shares(stream.weights, collection.cfg.trainer.quorum_groups)
    version = collection.run.version
    started, rounds = time.perf_counter(), 0
    while policy == "wait":
        have = Counter(stream.task_of[m[0].task_id] for _, m in pool if trains(collection.cfg, m, version))
        short = {k: q - have[k] for k, q in quota.items() if have[k] < q}
        if not short or rounds >= collection.cfg.task.share_max_wait_rounds:
            break
        rounds += 1
        flying = Counter(stream.task_of[inst["task_id"]] for inst in collection.in_flight.values())
        # nothing (enough) of a short task in flight: launch what it lacks
        lacking = {name: missing - flying[name] for name, missing in short.items() if flying[name] < missing}
        more, launched = collection.launch_for(lacking, step, f"{step}.w{rounds}")
        counts["share/launched_for_share"] += launched
        pool += [(returned.get(g, {}), m) for g, m in _by_group(more).items()]
    counts["share/wait_rounds"] = float(rounds)
    counts["share/wait_s"] = time.perf_counter() - started if rounds else 0.0
    taken, held, took = [], [], Counter()
    for instance, members in pool:
        name = stream.task_of[members[0].task_id]
        if not trains(collection.cfg, members, version):
            taken += members                      # dropped at admission, counted there: no share, not held
        elif took[name] < quota[name]:
            took[name] += 1
            taken += members
        else:
            held.append((instance, members))
    stream.held = held
    counts["share/held_groups"] = float(len(held))
    counts["share/short_groups"] = float(sum(max(0, q - took[k]) for k, q in quota.items()))
    _set_pipeline(collection, stream, held)
    return taken, counts


def _set_pipeline(collection: Any, stream: MixtureStream, held: list) -> None:
    """The stream's view of each task's groups in flight or held (what its next draws balance)."""
    pipeline = Counter(stream.task_of[inst["task_id"]] for inst in collection.in_flight.values()
                       if inst.get("task_id") in stream.task_of)
    pipeline.update(stream.task_of[m[0].task_id] for _, m in held)
    stream.set_pipeline(pipeline, capacity=collection.cfg.trainer.groups_in_flight)


def share_metrics(stream: MixtureStream, trajectories: list, tolerance: float) -> dict[str, float]:
    """This step's share per task, the cumulative share over the run, and whether it is outside tolerance."""
    groups = Counter(stream.task_of.get(t.task_id, "?") for t in {t.group_id: t for t in trajectories}.values())
    total = sum(groups.values())
    stream.trained.update(groups)
    cumulative = stream.trained
    run_total = sum(v for k, v in cumulative.items() if k in stream.weights)
    weight_total = sum(stream.weights.values())
    out = {}
    outside = 0.0
    for name, w in stream.weights.items():
        target = w / weight_total
        out[f"share/{name}"] = groups[name] / total if total else 0.0
        run_share = cumulative[name] / run_total if run_total else 0.0
        out[f"share/{name}_run"] = run_share
        if run_total and abs(run_share - target) > tolerance * target:
            outside = 1.0
    out["share/outside_tolerance"] = outside
    return out
