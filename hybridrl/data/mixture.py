"""The training stream of a task mixture: which task, and which of its prompts, comes next.

Which task (`next(n)`): each task by its declared weight, deterministically (the task furthest
below its share goes next), counted over

    share_policy=none     every prompt drawn so far (the draws hold the weights; what completes first
                          is what a step trains on)
    share_policy=wait     the task's groups in the pipeline: in flight or held for the next step (set by
                          the collection each step, `set_pipeline`), each task capped at its share of
                          the collection's groups in flight: a task whose complete groups wait for a
                          slow one's is not launched again until they are trained (fewer than n may
                          come back; the collection launches what it gets)
    share_policy=launch   the same, against weights scaled by each task's latency (steps from launch to
                          return, averaged): a task 10x slower keeps ~10x more groups in flight

Which prompt of the task: `sampler=uniform`, its shuffled order (`ShuffledStream`, a reshuffle per
epoch); `sampler=difficulty`, prompt i drawn with probability

    p_i = floor / N + (1 - floor) * w_i / sum_j w_j,   w_i = 4 s_i (1 - s_i), or 1 if never seen

where s_i is its success rate over its last `window` scored episodes (`observe`; INFRA_INVALID and
ABORTED ones are not the policy's and are left out). A prompt every sample
solves (s = 1), or none does (s = 0), carries no group signal and is drawn less; no prompt's
probability falls below floor / N (its task's N prompts). The prompts of one call are distinct
(drawn one after another without replacement, each from `p` over those left).

The difficulty sampler reweights the objective: the expected gradient of a step is sum_i p_i x (prompt
i's gradient), not the uniform mean over the split, and no importance weight corrects it (a curriculum
by design: the prompts that carry a group signal get the updates). Prompt i weighs N p_i = floor +
(1 - floor) N w_i / sum_j w_j times what it weighs under uniform draws; `config show --explain` states
it. `sampler=uniform` optimises the split's uniform mean.

Per-task statistics (`observe`): attempts, successes, response tokens and episode seconds, groups;
`step_metrics` reports them as `task/<name>/*`. Everything is a stateful part of the run's
checkpoint (`state_dict`): the streams' cursors, the prompt statistics, the generator, the counts,
and the instances of groups held back for the next step (a resumed run launches them first).
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from typing import Any, Iterable, Sequence

from hybridrl.data.episode import TaskInstance
from hybridrl.data.stream import ShuffledStream


def success(trajectory: Any) -> float:
    return 1.0 if trajectory.rewards.get("correct", trajectory.reward) > 0 else 0.0


def scored(trajectory: Any) -> bool:
    """Whether an episode (a `Trajectory`) says anything about the policy: INFRA_INVALID (a tool, engine or
    reward failure) and ABORTED (cancelled) episodes do not, and never count as a prompt's failures."""
    return trajectory.status not in ("infra_invalid", "aborted")      # TrajectoryStatus is a str enum


def deficit_order(weights: dict[str, float], counts: dict[str, float]) -> str:
    """The task furthest below its share of `counts` (ties: declaration order)."""
    total_w = sum(weights.values())
    total = sum(counts.get(k, 0) for k in weights) + 1
    return max(weights, key=lambda k: weights[k] / total_w * total - counts.get(k, 0))


class MixtureStream:
    def __init__(self, tasks: dict[str, Sequence[TaskInstance]], weights: dict[str, float], *, seed: int,
                 sampler: str = "uniform", floor: float = 0.25, window: int = 8, share_policy: str = "none"):
        self.weights = dict(weights)
        self.streams = {name: ShuffledStream(items, seed=f"{seed}/{name}") for name, items in tasks.items()}
        self.task_of = {inst.task_id: name for name, s in self.streams.items() for inst in s.items}
        self.sampler, self.floor, self.window, self.share_policy = sampler, floor, window, share_policy
        self.rng = random.Random(f"{seed}/mixture")
        self.drawn: Counter = Counter()
        self.pipeline: Counter = Counter()             # groups in flight or held, per task (the collection's)
        self.capacity = 0                              # the collection's groups in flight (0: no cap yet)
        self.latency: dict[str, float] = {}            # steps from launch to return, per task (a running mean)
        self.recent: dict[str, list[float]] = {}       # prompt id -> its last `window` successes
        self.totals: dict[str, Counter] = {name: Counter() for name in tasks}
        self.trained: Counter = Counter()              # groups per task that steps trained on, over the run
        self.relaunch: list[dict] = []                 # a resumed run: held groups' instances, drawn first
        self.held: list[tuple[dict, list]] = []        # (instance, members): complete groups held for the next step
        self.only: str | None = None                   # draw only this task (a share that waits on it)

    @property
    def items(self) -> list[TaskInstance]:
        return [inst for s in self.streams.values() for inst in s.items]

    # ------------------------------------------------------------------ drawing

    def next(self, n: int) -> list[TaskInstance]:
        out: list[TaskInstance] = [TaskInstance.from_dict(d) for d in self.relaunch[:n]]
        self.relaunch = self.relaunch[n:]
        order = [name for name in (self._task_next() for _ in range(n - len(out))) if name is not None]
        drawn = {name: iter(self._draw(name, k)) for name, k in Counter(order).items()}
        out += [next(drawn[name]) for name in order]
        return out

    def _task_next(self) -> str | None:
        """The next draw's task (None: every task is at its cap in the pipeline)."""
        if self.only is not None:
            name = self.only
        elif self.share_policy == "none":
            name = deficit_order(self.weights, self.drawn)
        else:
            weights = self.pipeline_weights()
            if self.capacity:
                total = sum(weights.values())
                weights = {k: w for k, w in weights.items()
                           if self.pipeline[k] < math.ceil(self.capacity * w / total - 1e-9)}
                if not weights:
                    return None
            name = deficit_order(weights, self.pipeline)
        self.drawn[name] += 1
        self.pipeline[name] += 1
        return name

    def _draw(self, name: str, k: int) -> list[TaskInstance]:
        stream = self.streams[name]
        if self.sampler == "uniform":
            return stream.next(k)
        items = list(stream.items)
        probs = self.probabilities(name)
        out = []
        for _ in range(min(k, len(items))):
            i = self.rng.choices(range(len(items)), weights=probs)[0]
            out.append(items.pop(i))
            probs.pop(i)
        return out + stream.next(k - len(out)) if k > len(out) else out

    def pipeline_weights(self) -> dict[str, float]:
        """The weights the pipeline is balanced to: the declared ones, or (launch) scaled by each task's
        latency in steps, so a slow task has proportionally more groups in flight."""
        if self.share_policy != "launch":
            return dict(self.weights)
        return {k: w * max(1.0, self.latency.get(k, 1.0)) for k, w in self.weights.items()}

    def probabilities(self, name: str) -> list[float]:
        """The difficulty sampler's draw probability of each prompt of task `name` (in its split's order)."""
        items = self.streams[name].items
        w = [self._signal(inst.task_id) for inst in items]
        total = sum(w)
        n = len(items)
        if total == 0:
            return [1.0 / n] * n
        return [self.floor / n + (1 - self.floor) * wi / total for wi in w]

    def _signal(self, task_id: str) -> float:
        recent = self.recent.get(task_id)
        if not recent:
            return 1.0
        s = sum(recent) / len(recent)
        return 4.0 * s * (1.0 - s)

    # ------------------------------------------------------------------ what happened

    def observe(self, trajectories: Iterable[Any], step: int | None = None) -> None:
        """The step's trajectories: prompt success rates and per-task totals of the scored ones (`scored`),
        and (with a step) latencies."""
        for t in trajectories:
            name = self.task_of.get(t.task_id)
            if name is None:
                continue
            if not scored(t):
                self.totals[name]["not_scored"] += 1
                continue
            recent = self.recent.setdefault(t.task_id, [])
            recent.append(success(t))
            del recent[: max(0, len(recent) - self.window)]
            tot = self.totals[name]
            tot["attempts"] += 1
            tot["successes"] += success(t)
            tot["response_tokens"] += len(t.response_ids)
            tot["seconds"] += float(t.timings.get("total_s", 0.0))
        if step is not None:
            for group, members in _groups(trajectories).items():
                name = self.task_of.get(members[0].task_id)
                launched = launch_step(group)
                if name is not None and launched is not None:
                    steps = float(step - launched + 1)
                    self.latency[name] = steps if name not in self.latency else 0.5 * (self.latency[name] + steps)

    def set_pipeline(self, counts: dict[str, int], capacity: int = 0) -> None:
        self.pipeline = Counter({k: int(v) for k, v in counts.items()})
        self.capacity = capacity

    def step_metrics(self, trajectories: Sequence[Any]) -> dict[str, float]:
        """`task/<name>/*` of this step's collected trajectories, and each task's share of them (groups
        collected; `share/<name>` is the share of the groups trained, `controller/curriculum.py`)."""
        out: dict[str, float] = {}
        by_task: dict[str, list] = defaultdict(list)
        for t in trajectories:
            by_task[self.task_of.get(t.task_id, "?")].append(t)
        groups = {name: len({t.group_id for t in ts}) for name, ts in by_task.items()}
        total_groups = sum(groups.values())
        for name in self.weights:
            ts = by_task.get(name, [])
            out[f"task/{name}/groups"] = float(groups.get(name, 0))
            out[f"task/{name}/share"] = groups.get(name, 0) / total_groups if total_groups else 0.0
            out[f"task/{name}/attempts"] = float(len(ts))
            out[f"task/{name}/drawn_total"] = float(self.drawn[name])
            judged = [t for t in ts if scored(t)]
            if judged:
                out[f"task/{name}/success_rate"] = sum(map(success, judged)) / len(judged)
            if ts:
                out[f"task/{name}/mean_length"] = sum(len(t.response_ids) for t in ts) / len(ts)
                out[f"task/{name}/latency_s"] = sum(float(t.timings.get("total_s", 0.0)) for t in ts) / len(ts)
            if name in self.latency:
                out[f"task/{name}/latency_steps"] = self.latency[name]
        return out

    # ------------------------------------------------------------------ a stateful part of the checkpoint

    def state_dict(self) -> dict:
        state = self.rng.getstate()
        return {"streams": {k: s.state_dict() for k, s in self.streams.items()}, "drawn": dict(self.drawn),
                "pipeline": dict(self.pipeline), "capacity": self.capacity, "latency": dict(self.latency), "recent": dict(self.recent),
                "totals": {k: dict(v) for k, v in self.totals.items()}, "trained": dict(self.trained),
                "rng": [state[0], list(state[1]), state[2]],
                "relaunch": list(self.relaunch) + [instance for instance, _ in self.held]}

    def load_state_dict(self, state: dict) -> None:
        for k, s in state["streams"].items():
            self.streams[k].load_state_dict(s)
        self.drawn = Counter(state["drawn"])
        self.pipeline = Counter(state["pipeline"])
        self.capacity = int(state.get("capacity", 0))
        self.latency = dict(state["latency"])
        self.recent = {k: list(v) for k, v in state["recent"].items()}
        self.totals = {k: Counter(v) for k, v in state["totals"].items()}
        self.trained = Counter(state.get("trained", {}))
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.relaunch = list(state["relaunch"])
        self.held = []


def _groups(trajectories: Iterable[Any]) -> dict[str, list]:
    out: dict[str, list] = {}
    for t in trajectories:
        out.setdefault(t.group_id, []).append(t)
    return out


def launch_step(group_id: str) -> int | None:
    """The step a group was launched at, from its id (`task_id@12`, `@12.1`, `@12.s1`, `@12r`)."""
    label = group_id.rsplit("@", 1)[-1]
    digits = ""
    for ch in label:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None
