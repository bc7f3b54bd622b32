"""How a step gets its trajectories (`trainer.rollout_mode`), on the controller.

    sync     draw `prompts_per_step` instances, run `group_size` episodes of each to the end
             (`RolloutSide.rollout`); the step waits for its slowest episode.
    partial  keep `groups_in_flight = ceil(prompts_per_step * oversample)` groups in flight: draw
             as many new instances as groups left since the last step, launch them, and end the
             rollout when `quorum` groups are complete over all engines (or at
             `rollout_deadline_s`); the episodes still running are interrupted at a token boundary
             and continue at the next step on the newly published policy (`RolloutSide.collect`,
             `agent/collector.py`). A step trains on complete groups only.

`trainer.dynamic_sampling` (both modes): keep launching groups, up to `max_sampling_rounds`
rounds, until the step holds `prompts_per_step` groups whose rewards are not all equal.
`algo.stale=requeue` (partial): a returned group with a token older than `algo.max_policy_lag`
versions leaves the step whole and its prompt is launched again at the next step, once per
staleness (with `drop` the trajectory filter drops such trajectories, `filter/policy_lag`).

Both return the step's trajectories and the collection's metrics (`partial/*`, `dynamic/*`,
`stale/*`). A collection drives the rollout side through its placement's link (`ModeSwitchLink`:
the colocated mode switch; `RemoteLink`: publication to separate rollout ranks).

`trainer.max_groups_per_step` (partial): a step trains at most that many complete groups, oldest
first; the rest wait in a `GroupQueue` bounded in groups and tokens (`data/queue.py`). Policy
`block`: the controller launches no more groups than the queue has room for, counting the groups
in flight (so the queue can never overflow); `drop_oldest`: launches go on and the oldest queued
groups are dropped, counted in `queue/dropped_*`.

Checkpoints (partial): the workers hand over every group in flight (`RolloutSide.hand_over`): its
members that ended, its episodes paused mid-turn saved whole (`agent/saved.py`: token history,
per-token versions and logprobs, the turn in progress, the agent's state, the wall clock left) and,
for an episode that cannot be saved (a front end that cannot continue one, an environment session),
its prompt. The checkpoint keeps them; the next step takes them back (`collect(held=...)`), in the
run that wrote the checkpoint as in one resumed from it, so both make the same requests after it and
a killed-and-resumed run is the uninterrupted one, bitwise. A saved episode continues as a new
segment of its turn, under the version served then. Groups waiting for a requeue or queued are
held as their prompts and launched again, from scratch, once, before new prompts are drawn.
`<run.dir>/groups.jsonl` records per step the prompts drawn, the groups returned and those still in
flight, so that exactly-once can be checked from the run's own records.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Mapping

from hybridrl.algo.filters import admit, informative_groups, stale_groups
from hybridrl.controller import curriculum
from hybridrl.controller import metrics as M
from hybridrl.controller.link import Link
from hybridrl.data.queue import GroupQueue
from hybridrl.data.trajectory import Trajectory, from_batch
from hybridrl.store.checkpoints import Blob
from hybridrl.workers.remote import RemotePublication, StreamProducer
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.switch import ModeSwitch


def admitted(cfg: Any, trajectories: list[Trajectory], version: int):
    """The trajectories an update would admit (`algo.filters.admit` with this run's settings: the overlong
    penalty, then the filters), with the reasons of the others."""
    return admit(trajectories, cfg.algo, current_version=version, max_response_tokens=cfg.agent.max_response_tokens)


def informative_admitted(cfg: Any, trajectories: list[Trajectory], version: int) -> set[str]:
    """What dynamic sampling counts: the groups whose members an update would admit (after the filters
    dropped the others) do not all have the same reward."""
    return informative_groups(admitted(cfg, trajectories, version).kept)


def lag_histogram(trajectories: list[Trajectory], version: int) -> dict[str, float]:
    """Trajectories by versions between their oldest policy token and the update at `version`."""
    out = {key: 0.0 for key in ("lag/0", "lag/1", "lag/2", "lag/3+")}
    for t in trajectories:
        lag = version - min(t.versions) if t.versions else 0
        out[f"lag/{lag}" if lag < 3 else "lag/3+"] += 1.0
    return out


class ModeSwitchLink(Link):
    """The colocated placement's link, as the controller drives it: the mode switch."""

    def __init__(self, wg: Any):
        self.wg = wg

    def to_rollout(self, version: int, step: int) -> dict:
        return self.wg.call(ModeSwitch.enter_rollout, version=version, step=step)

    def to_train(self) -> dict:
        return self.wg.call(ModeSwitch.enter_train)

    def ensure_rollout(self, version: int, step: int) -> dict | None:
        """Serving `version` for a validation; the switch made (None when the workers were serving)."""
        return self.to_rollout(version, step) if self.wg.call(ModeSwitch.mode) != "rollout" else None

    def ensure_train(self) -> None:
        if self.wg.call(ModeSwitch.mode) != "train":
            self.to_train()


class RemoteLink(Link):
    """The disaggregated placement's link: publication to the rollout ranks, which never stop."""

    def __init__(self, wg: Any):
        self.wg = wg

    def to_rollout(self, version: int, step: int) -> dict:
        return self.wg.call(RemotePublication.publish, version=version, step=step)

    def to_train(self) -> dict:
        return {}        # the rollout ranks keep generating; the training ranks never left training

    def ensure_rollout(self, version: int, step: int) -> dict:
        return self.to_rollout(version, step)

    def ensure_train(self) -> None:
        return None


class SyncCollection:
    def __init__(self, cfg: Any, wg: Any, run: Any, link: Any = None):
        self.cfg, self.wg, self.run, self.link = cfg, wg, run, link
        self.rollout_dp = wg.mesh("rollout").dp_size

    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        tc = self.cfg.trainer
        out: list[Trajectory] = []
        want, rounds = tc.prompts_per_step, 0
        while True:
            instances = self.run.stream.next(want)
            label = step if rounds == 0 else f"{step}.{rounds}"
            out += from_batch(self.wg.call(RolloutSide.rollout, M.episode_rows(instances, tc.group_size, label)))
            rounds += 1
            short = tc.prompts_per_step - len(informative_admitted(self.cfg, out, self.run.version))
            if not tc.dynamic_sampling or short <= 0 or rounds >= tc.max_sampling_rounds:
                break
            want = math.ceil(short / self.rollout_dp) * self.rollout_dp     # groups stay whole on one engine
        return curriculum.after_rollout(self, step, out, {     # task.mixture: per-task statistics
            "dynamic/rounds": float(rounds),
            "dynamic/informative_groups": float(len(informative_admitted(self.cfg, out, self.run.version)))}
            if tc.dynamic_sampling else {})

    # a stateful part of the run's checkpoint: a synchronous step leaves nothing between steps
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


class PartialCollection:
    def __init__(self, cfg: Any, wg: Any, run: Any, link: Any = None):
        self.cfg, self.wg, self.run, self.link = cfg, wg, run, link
        self.in_flight: dict[str, dict] = {}      # group id -> its instance (launched, not yet returned)
        self.requeued: list[dict] = []            # instances of stale groups, launched first at the next step
        self.relaunch: list[dict] = []             # a resumed run: what the checkpoint had to launch again
        self.held: list = []                       # groups the workers handed over at a checkpoint (agent/saved.py)
        tc = cfg.trainer
        self.queue = GroupQueue(max_groups=tc.queue_max_groups, max_tokens=tc.queue_max_tokens,
                                policy=tc.queue_policy) if tc.max_groups_per_step else None
        self.queued_instances: dict[str, dict] = {}
        self.returned_instances: dict[str, dict] = {}   # group id -> its instance, for the groups returned this step
        self.blocked_launches = 0
        self.drawn: list[str] = []

    def _launch(self, n: int, step: int, label: str) -> list[dict]:
        if self.relaunch:                          # after a resume: all of them, before anything new
            requeued, self.relaunch = self.relaunch + self.requeued, []
            self.requeued = []
            n = max(n, len(requeued))
        else:
            requeued, self.requeued = self.requeued[:n], self.requeued[n:]
        fresh = self.run.stream.next(max(0, n - len(requeued)))
        self.drawn += [inst.task_id for inst in fresh]
        rows = M.episode_rows(fresh, self.cfg.trainer.group_size, label)
        episodes = [{"instance": i, "attempt": a, "group_id": g}
                    for i, a, g in zip(rows["instance"], rows["attempt"], rows["group_id"])] if fresh else []
        for inst in requeued:
            episodes += [{"instance": inst, "attempt": a, "group_id": f"{inst['task_id']}@{label}r"}
                         for a in range(self.cfg.trainer.group_size)]
        for e in episodes:
            self.in_flight[e["group_id"]] = e["instance"]
        return episodes

    def _collect(self, episodes: list[dict], quorum: int, deadline_s: float, stats: list,
                 counts: dict[str, float]) -> list[Trajectory]:
        tc, algo = self.cfg.trainer, self.cfg.algo
        held, self.held = self.held, []
        outs = self.wg.call(RolloutSide.collect, episodes=episodes, quorum=quorum, deadline_s=deadline_s,
                            poll_s=tc.collect_poll_s, informative_only=tc.dynamic_sampling,
                            **({"held": held} if held else {}))
        stats += [out["stats"] for out in outs]
        trajectories = [t for out in outs for t in out["trajectories"]]
        returned = {g: self.in_flight.pop(g) for g in dict.fromkeys(t.group_id for t in trajectories)}
        self.returned_instances.update(returned)
        if algo.stale == "requeue" and algo.max_policy_lag >= 0:
            stale = stale_groups(trajectories, self.run.version, algo.max_policy_lag)
            self.requeued += [returned[g] for g in returned if g in stale]
            counts["stale/requeued_groups"] += len(stale)
            counts["stale/requeued_episodes"] += sum(t.group_id in stale for t in trajectories)
            trajectories = [t for t in trajectories if t.group_id not in stale]
        return trajectories

    def launch_for(self, lacking: Mapping[str, int], step: int, label: str) -> tuple[list[Trajectory], int]:
        """`task.share_policy=wait`: launch `lacking[task]` more groups of each task short of its share of the
        step, then collect what completes first (at least one group, these or any in flight);
        (those trajectories, the number of groups launched)."""
        stream = self.run.stream
        launched: list[dict] = []
        for name, n in lacking.items():
            stream.only = name
            try:
                launched += self._launch(n, step, label)
            finally:
                stream.only = None
        more = self._collect(launched, 1, 0.0, [], Counter())
        return more, len({e["group_id"] for e in launched})

    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        tc = self.cfg.trainer
        stats: list[dict] = []
        self.drawn = []
        self.returned_instances = {}
        counts = {"stale/requeued_groups": 0.0, "stale/requeued_episodes": 0.0}
        want = max(0, tc.groups_in_flight - len(self.in_flight))
        if self.queue is not None and self.queue.policy == "block":   # every launched group must find room
            room = max(0, self.queue.room() - len(self.in_flight))
            self.blocked_launches += max(0, want - room)
            want = min(want, room)
        launched = self._launch(want, step, str(step))
        trajectories = self._collect(launched, tc.quorum_groups, tc.rollout_deadline_s, stats, counts)
        retries = 0
        while not trajectories:     # nothing complete by the deadline, or every group stale: wait for one
            retries += 1
            more = self._launch(len(self.requeued), step, f"{step}.s{retries}")
            launched += more
            trajectories = self._collect(more, 1, 0.0, stats, counts)
        rounds = 1
        while tc.dynamic_sampling and rounds < tc.max_sampling_rounds:
            short = tc.prompts_per_step - len(informative_admitted(self.cfg, trajectories, self.run.version))
            if short <= 0:
                break
            more = self._launch(short, step, f"{step}.{rounds}")
            launched += more
            trajectories += self._collect(more, short, 0.0, stats, counts)
            rounds += 1
        queue_metrics: dict[str, float] = {}
        if self.queue is not None:
            trajectories, queue_metrics = self._through_queue(trajectories)
        self._record(step, trajectories)
        # continued across a step: interrupted mid-request, or paused in a tool call and resumed on a newer version
        continued = [t for t in trajectories if t.metadata.get("interruptions") or len(t.versions) > 1]
        last = stats[-self.wg.world_size:]          # the last call's counters, one per rank
        metrics = dict(counts) if self.cfg.algo.stale == "requeue" else {}
        metrics.update(queue_metrics)
        metrics.update({
            "partial/launched_groups": float(len({e["group_id"] for e in launched})),
            "partial/returned_groups": float(len({t.group_id for t in trajectories})),
            "partial/groups_in_flight": float(len(self.in_flight)),
            "partial/interrupted": float(sum(s["interrupted"] for s in stats)),
            "partial/live_episodes": float(sum(s["live"] for s in last)),
            "partial/live_tokens": float(sum(s["live_tokens"] for s in last)),
            "partial/waiting_episodes": float(sum(s["waiting"] for s in last)),
            "partial/continued_episodes": float(len(continued)),
            "partial/multi_version_episodes": float(sum(len(t.versions) > 1 for t in trajectories)),
            "partial/stopped_by_deadline": float(any(s["stopped_by"] == "deadline" for s in stats)),
        })
        metrics.update(lag_histogram(trajectories, self.run.version))
        if tc.dynamic_sampling:
            metrics["dynamic/rounds"] = float(rounds)
            metrics["dynamic/informative_groups"] = float(len(informative_admitted(self.cfg, trajectories,
                                                                                   self.run.version)))
        return curriculum.after_rollout(self, step, trajectories, metrics, partial=True)   # task.mixture: shares

    # a stateful part of the run's checkpoint
    def state_dict(self) -> dict:
        """The groups in flight as the workers hand them over (`RolloutSide.hand_over`: their ended members,
        their episodes saved mid-turn, the attempts that run again from the prompt), taken back at the next
        step in this run as in a resumed one; and the prompts waiting for a requeue or queued, which a
        resumed run launches again, from scratch, once, before drawing new prompts."""
        self.held = [g for rank in self.wg.call(RolloutSide.hand_over) for g in rank]
        return {**self._prompts(), "held": Blob(self.held)}

    def _prompts(self) -> dict:
        return {"in_flight": dict(self.in_flight), "requeued": list(self.requeued),
                "queued": list(self.queued_instances.values())}

    def load_state_dict(self, state: dict) -> None:
        if "held" not in state:                    # a checkpoint that holds the prompts in flight only
            self.relaunch = [*state.get("in_flight", {}).values(), *state.get("requeued", []), *state.get("queued", [])]
            return
        self.in_flight, self.held = dict(state["in_flight"]), list(state["held"])
        self.relaunch = [*state.get("requeued", []), *state.get("queued", [])]

    def _record(self, step: int, trajectories: list[Trajectory]) -> None:
        """This step's row of groups.jsonl."""
        with (Path(self.cfg.run.dir) / "groups.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "drawn": self.drawn,
                                "returned": sorted({t.group_id for t in trajectories}),
                                "in_flight": sorted(self.in_flight), "requeued": [i["task_id"] for i in self.requeued],
                                "queued": sorted(self.queued_instances)})
                    + "\n")

    def _through_queue(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], dict[str, float]]:
        """The returned groups enter the queue; the step takes the oldest `max_groups_per_step`."""
        assert self.queue is not None
        groups: dict[str, list[Trajectory]] = defaultdict(list)
        for t in trajectories:
            groups[t.group_id].append(t)
        before = dict(self.queue.counts)
        taken = self.queue.get(self.cfg.trainer.max_groups_per_step)        # the oldest first ...
        fresh = list(groups.items())
        direct = self.cfg.trainer.max_groups_per_step - len(taken)
        taken += [members for _, members in fresh[:direct]]                 # ... then this step's
        for g, members in fresh[direct:]:
            self.queue.put(members, timeout=0)        # block: the launches left room for it
            self.queued_instances[g] = self.returned_instances[g]
        queued = {m[0].group_id for m in self.queue.state()}
        self.queued_instances = {g: i for g, i in self.queued_instances.items() if g in queued}
        c = self.queue.counts
        return [t for group in taken for t in group], {
            "queue/groups": float(len(self.queue)), "queue/tokens": float(self.queue.tokens),
            "queue/bytes": float(self.queue.bytes),
            "queue/dropped_groups": float(c["dropped_groups"] - before["dropped_groups"]),
            "queue/dropped_trajectories": float(c["dropped_trajectories"] - before["dropped_trajectories"]),
            "queue/blocked_launches": float(self.blocked_launches)}


NO_LOWER_FLOOR = 2**62


class StreamCollection(PartialCollection):
    """The disaggregated placement: the rollout ranks generate without pause; a step takes its groups.

    Groups are granted ahead: after step s takes its groups, the groups of steps s+1 .. s+ahead
    (ahead = max(1, max_policy_lag)) are granted to the rollout ranks, group i to rollout rank i % R,
    each with a floor, the oldest policy version its tokens may come from: the version the step
    will train at (assuming every step updates) minus `algo.max_policy_lag`. A rollout rank starts
    a group once its engine serves the floor, so with lag 0 a step's groups wait for the previous
    update's publication (rollout and training take turns) and with lag 1 they run while that update
    trains. A step that did not update lowers the floors to what is admissible now (`take`).
    The bound holds by construction, and the admission filter checks it again (`filter/policy_lag`).

    Backpressure: at most `ahead` steps of groups exist beyond the one being taken (launched or
    waiting, never dropped); complete groups wait on their rollout rank until taken.

    Checkpoints: a checkpoint takes every group granted ahead once it is complete (those groups end
    on the versions they started on) and keeps them; the step they belong to trains on the kept
    groups, in a resumed run exactly as in the uninterrupted one. The rollout ranks report their
    counters per take (`StreamProducer.take`), so a resumed run's counters continue where the
    checkpoint left them.
    """

    def __init__(self, cfg: Any, wg: Any, run: Any, link: Any):
        super().__init__(cfg, wg, run, link)
        self.lag = cfg.algo.max_policy_lag
        self.ahead = max(1, self.lag)
        self.granted: dict[int, tuple[list[list[dict]], int]] = {}   # step -> (its groups, floor), not taken
        self.finished: dict[int, list[dict]] = {}      # step -> what its take returned (taken at a checkpoint)
        self.serving = 0                               # the version the rollout ranks serve (this step's)
        self.regrant: dict[int, tuple[list[list[dict]], int]] = {}   # a resumed run: grants to issue again

    def _grant(self, step: int, floor: int, update_follows: bool = False) -> None:
        episodes = self._launch(self.cfg.trainer.prompts_per_step, step, str(step))
        groups: dict[str, list[dict]] = {}
        for e in episodes:
            groups.setdefault(e["group_id"], []).append(e)
        self._issue(step, list(groups.values()), floor, update_follows)

    def _issue(self, step: int, groups: list[list[dict]], floor: int, update_follows: bool = False) -> None:
        """`update_follows`: this step's update is published before these groups are taken (it may land on
        them while they run, with updates in flight: `workers/remote.py`)."""
        self.wg.call(StreamProducer.grant, groups=groups, floor=floor, update_follows=update_follows)
        self.granted[step] = (groups, floor)

    def _take(self, step: int, floor: int, settle: bool = False) -> list[dict]:
        groups, _ = self.granted.pop(step)
        return self.wg.call(StreamProducer.take, group_ids=[g[0]["group_id"] for g in groups], floor=floor,
                            settle=settle)

    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        version, total = self.run.version, self.cfg.trainer.total_steps
        self.serving = version
        self.drawn = []
        for later, (groups, floor) in sorted(self.regrant.items()):    # after a resume: as they were granted
            self._issue(later, groups, floor)
        self.regrant = {}
        if step not in self.granted and step not in self.finished:    # the first step (or the first after a resume)
            self._grant(step, version - self.lag)
        started = time.perf_counter()
        outs = self.finished.pop(step) if step in self.finished else self._take(step, version - self.lag)
        waited = time.perf_counter() - started
        trajectories = [t for out in outs for t in out["trajectories"]]
        for g in dict.fromkeys(t.group_id for t in trajectories):
            self.in_flight.pop(g)
        for ahead in range(1, self.ahead + 1):         # the next steps' groups, while this one trains
            if step + ahead <= total and step + ahead not in self.granted and step + ahead not in self.finished:
                self._grant(step + ahead, version + ahead - self.lag, update_follows=True)
        self._record(step, trajectories)
        stats = [out["stats"] for out in outs if out["stats"]]
        deltas = {k: sum(s[k] for s in stats) for k in ("idle_s", "floor_waits", "launched_groups", "policy_tokens")}
        clock = max(s["clock_s"] for s in stats)
        metrics = {"stream/trainer_wait_s": waited, "stream/rollout_idle_s": deltas["idle_s"],
                   "stream/floor_waits": deltas["floor_waits"], "stream/launched_groups": deltas["launched_groups"],
                   "stream/returned_groups": float(len({t.group_id for t in trajectories})),
                   "stream/groups_in_flight": float(len(self.in_flight)),
                   "stream/complete_waiting": float(sum(s["complete_groups"] for s in stats)),
                   "stream/running_episodes": float(sum(s["running_episodes"] for s in stats)),
                   "stream/multi_version_episodes": float(sum(len(t.versions) > 1 for t in trajectories)),
                   **lag_histogram(trajectories, version)}
        busy = clock - deltas["idle_s"] / max(1, len(stats))
        if not any(s["first"] for s in stats):   # generation's own rate: policy tokens of the episodes ended
            metrics["gen/tokens_per_s"] = deltas["policy_tokens"] / busy if busy > 0 else 0.0   # since the last take
        return curriculum.after_rollout(self, step, trajectories, metrics)     # task.mixture: per-task statistics

    def state_dict(self) -> dict:
        """The groups granted ahead that can run on the version served now, taken once complete (they finish
        on the versions they started on); those waiting for a newer version have not started and are granted
        again as they were after a resume."""
        for step, (_, floor) in sorted(self.granted.items()):
            if floor <= self.serving:       # a floor no waiting group is above: lowers none of them
                self.finished[step] = self._take(step, NO_LOWER_FLOOR, settle=True)
        if self.cfg.rollout.engine_row.updates_in_flight(self.cfg):
            # updates in flight count a step's own groups; those this checkpoint let end were never run by a
            # resumed run, so they are counted in no step (the counters move past them here)
            M.engine_metrics(self.wg.call(RolloutSide.rollout_stats), self.run)
        return {**self._prompts(), "finished": Blob(self.finished),
                "waiting": {str(step): {"groups": groups, "floor": floor} for step, (groups, floor) in self.granted.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.in_flight = dict(state.get("in_flight", {}))
        self.finished = dict(state.get("finished", {}))
        self.regrant = {int(step): (w["groups"], w["floor"]) for step, w in state.get("waiting", {}).items()}
