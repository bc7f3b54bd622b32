"""A discrete-event simulation of the RL step loop under one configuration, from a measured workload.

Why simulate rather than add up stage times: batching and queueing interact non-linearly. A sync
step waits for its slowest episode while the engine's batch drains; partial rollouts carry the
slow ones into the next step; a disaggregated rollout rank runs a larger batch and overlaps the
update when the lag allows it. The simulation replays the measured episodes (whole groups, in a
seeded order) through the same rules the collectors apply:

    engines     one per rollout rank; a step advances every generating sequence of its batch (at most
                max_batch) by one token and takes engine.step_s(batch, prompt tokens computed in it)
                x rollout_factor seconds; an episode's turn needs its prompt tokens computed first
                (a continued turn recomputes its context: the new policy invalidates the cache)
    episodes    a launched episode starts after launch_s of its rank's event loop (one launch after
                another); per turn: generate its tokens, then wait its tool/environment seconds (wall clock:
                a tool call goes on while the engines are off), the last turn then its verifier
                seconds; at most max_concurrent episodes in flight per rank (admission waits)
    sync        a step launches prompts_per_step groups and waits for all of them
    partial     ceil(prompts x oversample) groups in flight; the rollout ends when `quorum`
                (= prompts_per_step) groups are complete; the engines stop (the step in progress is
                lost), the rest continue at the next step on the next version
    disaggregated  rollout ranks generate without pause; groups of step s are granted ahead with a
                floor (the version step s trains at minus max_policy_lag, ahead = max(1, lag) steps);
                a rank starts a group once it serves the floor; the trainer takes step s's groups
                when all are complete, trains, publishes (the rollout engines switch versions)
    admission   drop truncated (drop_truncated), infrastructure-invalid / aborted, the groups whose
                measured rewards were all equal (drop_all_equal_groups), and trajectories with a token
                older than max_policy_lag versions
    step time   colocated: sync + rollout + prep + train + store + controller; disaggregated: the
                trainer's wait for its groups + prep + train + store + controller + publish

Throughput is measured as a closed-loop run measures it: admitted policy tokens of the steps after
`warmup` and before the last, over the wall time between their ends.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from hybridrl.cost.workload import EpisodeShape, Workload


@dataclass
class Config:
    placement: str = "colocated"      # colocated | disaggregated
    train_ranks: int = 1
    rollout_ranks: int = 1            # colocated: the same ranks as train_ranks
    rollout_mode: str = "sync"        # sync | partial (colocated)
    oversample: float = 1.0
    max_policy_lag: int = -1          # -1: no lag filter
    prompts_per_step: int = 1
    group_size: int = 1
    max_concurrent: int = 64
    drop_truncated: bool = True
    drop_all_equal_groups: bool = True

    @property
    def world_size(self) -> int:
        return self.train_ranks if self.placement == "colocated" else self.train_ranks + self.rollout_ranks

    @property
    def groups_in_flight(self) -> int:
        return math.ceil(self.prompts_per_step * self.oversample - 1e-9)

    def label(self) -> str:
        if self.placement == "colocated":
            mode = "sync" if self.rollout_mode == "sync" else f"partial x{self.oversample:g}"
            return f"colocated {self.train_ranks} ranks, {mode}, lag {self._lag()}"
        return f"disaggregated {self.train_ranks} train + {self.rollout_ranks} rollout, lag {self._lag()}"

    def _lag(self) -> str:
        return "off" if self.max_policy_lag < 0 else str(self.max_policy_lag)

    def overrides(self) -> list[str]:
        """The run's config keys for this configuration."""
        out = [f"placement.mode={self.placement}", f"algo.max_policy_lag={self.max_policy_lag}",
               f"distributed.nproc_per_node={self.world_size}"]
        if self.placement == "disaggregated":
            out.append(f"placement.rollout_ranks={self.rollout_ranks}")
        else:
            out.append(f"trainer.rollout_mode={self.rollout_mode}")
            if self.rollout_mode == "partial":
                out.append(f"trainer.oversample={self.oversample:g}")
        return out


@dataclass
class SimResult:
    config: Config
    steps: list[dict]
    admitted_tokens_per_s: float
    step_s: float
    utilisation: dict[str, float]
    queue_depth: float
    lag_histogram: dict[str, int]
    admitted: dict[str, Any]
    launched: dict[str, Any]
    window: tuple[int, int]

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "label": self.config.label(),
                "admitted_tokens_per_s": self.admitted_tokens_per_s, "step_s": self.step_s,
                "utilisation": self.utilisation, "queue_depth": self.queue_depth,
                "lag_histogram": self.lag_histogram, "admitted": self.admitted, "launched": self.launched,
                "window": list(self.window), "steps": self.steps}


class _Group:
    __slots__ = ("id", "step", "floor", "members", "done", "complete_at", "rank", "all_equal", "started")

    def __init__(self, gid: int, step: int, shapes: list[EpisodeShape], all_equal: bool, rank: int, floor: int):
        self.id, self.step, self.floor, self.rank = gid, step, floor, rank
        self.members: list[_Episode] = []
        self.done = 0
        self.complete_at: float | None = None
        self.all_equal = all_equal
        self.started = False


class _Episode:
    __slots__ = ("shape", "group", "turn", "remaining", "prefill", "context", "state", "versions", "tokens",
                 "started_at", "ended_at", "seq")

    def __init__(self, shape: EpisodeShape, group: _Group, seq: int):
        self.shape, self.group, self.seq = shape, group, seq
        self.turn, self.remaining, self.prefill, self.context = 0, 0, 0, 0
        self.state = "new"
        self.versions: Counter = Counter()
        self.tokens = 0
        self.started_at = self.ended_at = 0.0


class _Engine:
    def __init__(self, rank: int):
        self.rank = rank
        self.gen: list[_Episode] = []
        self.waiting: list[_Episode] = []     # admission queue (over max_concurrent)
        self.in_flight = 0
        self.busy = False
        self.epoch = 0
        self.enabled = False
        self.version = 0
        self.busy_s = 0.0
        self.launch_clock = 0.0
        self.pending: list[_Group] = []       # disaggregated: granted groups not yet started


class Simulation:
    def __init__(self, workload: Workload, cfg: Config, *, seed: int | None = 0):
        """`seed` None: the groups in their measured order (a replay), else a seeded shuffle."""
        self.w, self.cfg = workload, cfg
        self.t = 0.0
        self.events: list = []
        self.seq = 0
        self.version = 0
        self.engines = [_Engine(r) for r in range(cfg.rollout_ranks)]
        order = list(range(len(workload.groups)))
        if seed is not None:
            random.Random(seed).shuffle(order)
        self.order, self.next_group = order, 0
        self.groups: list[_Group] = []
        self._dirty: set[int] = set()
        self.launched_shapes: list[EpisodeShape] = []
        self.tool_busy_s = 0.0

    # ------------------------------------------------------------------ machinery

    def _push(self, at: float, kind: str, obj: Any, epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, obj, epoch))

    def _draw(self, step: int, rank: int, floor: int) -> _Group:
        shapes = self.w.groups[self.order[self.next_group % len(self.order)]]
        self.next_group += 1
        rewards = [s.reward for s in shapes]
        g = _Group(len(self.groups), step, shapes, max(rewards) - min(rewards) <= 1e-9, rank, floor)
        self.groups.append(g)
        g.members = [_Episode(s, g, i) for i, s in enumerate(shapes)]
        self.launched_shapes += shapes
        return g

    def _start_group(self, g: _Group) -> None:
        g.started = True
        eng = self.engines[g.rank]
        for ep in g.members:
            ep.started_at = self.t
            if eng.in_flight < self.cfg.max_concurrent:
                self._admit(eng, ep)
            else:
                ep.state = "queued"
                eng.waiting.append(ep)

    def _admit(self, eng: _Engine, ep: _Episode) -> None:
        """An episode starts once the rank's event loop has spent `launch_s` on it (prompt rendering, the
        environment's reset), one launch after another."""
        eng.in_flight += 1
        if self.w.launch_s <= 0:
            self._begin_turn(eng, ep)
            return
        eng.launch_clock = max(eng.launch_clock, self.t) + self.w.launch_s
        ep.state = "launching"
        self._push(eng.launch_clock, "turn", ep)

    def _begin_turn(self, eng: _Engine, ep: _Episode) -> None:
        turn = ep.shape.turns[ep.turn] if ep.turn < len(ep.shape.turns) else None
        if turn is None or turn.generated <= 0:
            self._end_turn(eng, ep)
            return
        ep.state = "gen"
        ep.remaining = turn.generated
        ep.prefill = turn.prompt_tokens
        ep.context += turn.prompt_tokens
        eng.gen.append(ep)
        self._kick(eng)

    def _end_turn(self, eng: _Engine, ep: _Episode) -> None:
        turns = ep.shape.turns
        wait = turns[ep.turn].wait_s if ep.turn < len(turns) else 0.0
        ep.turn += 1
        if ep.turn < len(turns):
            ep.state = "wait"
            self.tool_busy_s += wait
            self._push(self.t + wait, "turn", ep)
        else:
            ep.state = "reward"
            self._push(self.t + ep.shape.reward_s, "done", ep)

    def _kick(self, eng: _Engine) -> None:
        """Ask for an engine step; it starts once every event of this instant is handled (requests that
        arrive together share the step)."""
        self._dirty.add(eng.rank)

    def _start_steps(self) -> None:
        for rank in sorted(self._dirty):
            self._step_now(self.engines[rank])
        self._dirty.clear()

    def _step_now(self, eng: _Engine) -> None:
        if eng.busy or not eng.enabled or not eng.gen:
            return
        batch = eng.gen[: self.w.engine.max_batch]
        prefill = sum(ep.prefill for ep in batch)
        for ep in batch:
            ep.prefill = 0
        dt = self.w.engine.step_s(len(batch), prefill) * self.w.rollout_factor
        eng.busy = True
        eng.busy_s += dt
        self._push(self.t + dt, "step", (eng, list(batch)), eng.epoch)

    def _on_step(self, eng: _Engine, batch: list[_Episode]) -> None:
        eng.busy = False
        for ep in batch:
            if ep.state != "gen":
                continue
            ep.remaining -= 1
            ep.tokens += 1
            ep.context += 1
            ep.versions[eng.version] += 1
            if ep.remaining <= 0:
                eng.gen.remove(ep)
                self._end_turn(eng, ep)
        self._kick(eng)

    def _on_done(self, ep: _Episode) -> None:
        ep.state = "done"
        ep.ended_at = self.t
        eng = self.engines[ep.group.rank]
        eng.in_flight -= 1
        if eng.waiting:
            self._admit(eng, eng.waiting.pop(0))
        g = ep.group
        g.done += 1
        if g.done == len(g.members):
            g.complete_at = self.t

    def _run_until(self, done: Callable[[], bool] | None = None, until: float | None = None) -> None:
        self._start_steps()
        while self.events:
            if done is not None and done():
                return
            at, _, kind, obj, epoch = self.events[0]
            if self._dirty and at > self.t:
                self._start_steps()             # this instant is over: its requests share a step
                continue
            if until is not None and at > until:
                break
            heapq.heappop(self.events)
            self.t = max(self.t, at)
            if kind == "step":
                eng, batch = obj
                if epoch == eng.epoch:
                    self._on_step(eng, batch)
            elif kind == "turn":
                self._begin_turn(self.engines[obj.group.rank], obj)
            elif kind == "done":
                self._on_done(obj)
            if not self.events:
                self._start_steps()
        if until is not None:
            self.t = max(self.t, until)

    def _set_engines(self, enabled: bool) -> None:
        for eng in self.engines:
            if eng.enabled and not enabled:
                eng.epoch += 1                  # the step in progress is interrupted (its tokens lost)
                if eng.busy:
                    eng.busy = False
                for ep in eng.gen:              # a continued turn recomputes its context on the new policy
                    ep.prefill = ep.context
            eng.enabled = enabled
            if enabled:
                self._kick(eng)

    # ------------------------------------------------------------------ admission

    def _admitted(self, episodes: list[_Episode], version: int) -> tuple[list[_Episode], Counter]:
        cfg, lag = self.cfg, Counter()
        out, reasons = [], Counter()
        for ep in episodes:
            lag_of = version - min(ep.versions) if ep.versions else 0
            if ep.shape.status in ("infra_invalid", "aborted"):
                reasons[ep.shape.status] += 1
            elif cfg.drop_truncated and ep.shape.truncated:
                reasons["truncated"] += 1
            elif cfg.max_policy_lag >= 0 and lag_of > cfg.max_policy_lag:
                reasons["policy_lag"] += 1
            elif cfg.drop_all_equal_groups and ep.group.all_equal:
                reasons["all_equal_group"] += 1
            else:
                out.append(ep)
                ep.state = "admitted"
                lag[lag_of] += 1
        return out, Counter({**{f"lag/{k}": v for k, v in lag.items()}, **{f"filter/{k}": v for k, v in reasons.items()}})

    # ------------------------------------------------------------------ the loops

    def run(self, steps: int, warmup: int) -> SimResult:
        rows = self._colocated(steps) if self.cfg.placement == "colocated" else self._disaggregated(steps)
        return self._result(rows, warmup)

    def _colocated(self, steps: int) -> list[dict]:
        cfg, ov, tr = self.cfg, self.w.overheads, self.w.trainer
        live: list[_Group] = []
        rows = []
        for step in range(1, steps + 1):
            t0 = self.t
            self._run_until(until=self.t + ov.sync_s)           # the switch: engines off, tools go on
            for eng in self.engines:
                eng.version = self.version
            want = cfg.prompts_per_step if cfg.rollout_mode == "sync" else max(0, cfg.groups_in_flight - len(live))
            for i in range(want):
                g = self._draw(step, (len(self.groups)) % cfg.rollout_ranks, 0)
                live.append(g)
                self._start_group(g)
            start = self.t
            self._set_engines(True)
            if cfg.rollout_mode == "sync":
                self._run_until(done=lambda: all(g.complete_at is not None for g in live))
            else:
                self._run_until(done=lambda: sum(g.complete_at is not None for g in live) >= cfg.prompts_per_step)
            rollout_s = self.t - start
            self._set_engines(False)
            returned = [g for g in live if g.complete_at is not None]
            live = [g for g in live if g.complete_at is None]
            episodes = [ep for g in returned for ep in g.members]
            kept, counts = self._admitted(episodes, self.version)
            tokens = sum(ep.tokens for ep in kept)
            train_s = tr.seconds(tokens, cfg.train_ranks) if kept else 0.0
            rest = ov.prep_s + ov.store_s + ov.controller_s + ov.periodic(step)
            self._run_until(until=self.t + train_s + rest)
            if kept:
                self.version += 1
            depth = sum(1 for g in live for ep in g.members if ep.state != "done")
            rows.append({"step": step, "start": t0, "end": self.t, "rollout_s": rollout_s, "train_s": train_s,
                         "admitted_tokens": tokens, "admitted": len(kept), "returned": len(episodes),
                         "queue_depth": depth, **counts,
                         "lengths": [ep.tokens for ep in kept], "rewards": [ep.shape.reward for ep in kept],
                         "engine_busy_s": sum(e.busy_s for e in self.engines)})
        return rows

    def _disaggregated(self, steps: int) -> list[dict]:
        cfg, ov, tr = self.cfg, self.w.overheads, self.w.trainer
        lag = max(cfg.max_policy_lag, 0)
        ahead = max(1, lag)
        granted: dict[int, list[_Group]] = {}

        def grant(step: int, floor: int) -> None:
            groups = []
            for i in range(cfg.prompts_per_step):
                g = self._draw(step, i % cfg.rollout_ranks, floor)
                self.engines[g.rank].pending.append(g)
                groups.append(g)
            granted[step] = groups
            start_eligible()

        def start_eligible() -> None:
            for eng in self.engines:
                for g in [g for g in eng.pending if eng.version >= g.floor]:
                    eng.pending.remove(g)
                    self._start_group(g)

        for eng in self.engines:
            eng.enabled = True
        rows = []
        for step in range(1, steps + 1):
            t0 = self.t
            version = self.version
            if step not in granted:
                grant(step, version - lag)
            groups = granted.pop(step)
            self._run_until(done=lambda: all(g.complete_at is not None for g in groups))
            wait_s = self.t - t0
            for k in range(1, ahead + 1):
                if step + k <= steps and step + k not in granted:
                    grant(step + k, version + k - lag)
            episodes = [ep for g in groups for ep in g.members]
            kept, counts = self._admitted(episodes, version)
            tokens = sum(ep.tokens for ep in kept)
            train_s = tr.seconds(tokens, cfg.train_ranks) if kept else 0.0
            self._run_until(until=self.t + train_s + ov.prep_s + ov.store_s + ov.controller_s + ov.publish_s
                            + ov.periodic(step))
            if kept:
                self.version += 1
                for eng in self.engines:
                    eng.version = self.version
                start_eligible()
            depth = sum(1 for e in self.engines for ep in e.gen) + sum(
                1 for g in self.groups if g.started and g.complete_at is None for ep in g.members if ep.state != "done")
            rows.append({"step": step, "start": t0, "end": self.t, "rollout_s": wait_s, "train_s": train_s,
                         "admitted_tokens": tokens, "admitted": len(kept), "returned": len(episodes),
                         "queue_depth": depth, **counts,
                         "lengths": [ep.tokens for ep in kept], "rewards": [ep.shape.reward for ep in kept],
                         "engine_busy_s": sum(e.busy_s for e in self.engines)})
        return rows

    def _result(self, rows: list[dict], warmup: int) -> SimResult:
        n = len(rows)
        lo, hi = min(warmup, n - 2), n - 1               # steps (lo, hi]: after the warm-up, before the last
        window = rows[lo:hi] if hi > lo else rows
        start = rows[lo - 1]["end"] if lo >= 1 else rows[0]["start"]
        wall = window[-1]["end"] - start
        tokens = sum(r["admitted_tokens"] for r in window)
        busy = window[-1]["engine_busy_s"] - (rows[lo - 1]["engine_busy_s"] if lo >= 1 else 0.0)
        train = sum(r["train_s"] for r in window)
        lags: Counter = Counter()
        for r in window:
            lags.update({k[4:]: v for k, v in r.items() if k.startswith("lag/")})
        lengths = [x for r in window for x in r["lengths"]]
        rewards = [x for r in window for x in r["rewards"]]
        util = {"rollout": busy / (wall * self.cfg.rollout_ranks) if wall else 0.0,
                "train": train / wall if wall else 0.0}
        shapes = self.launched_shapes
        # selection: of the episodes launched in the window's first part (late launches may still run
        # at the end), which were admitted; a length-blind admission keeps their mean length
        tail = max([int(k) for k in lags] + [1]) + 1
        cohort = [ep for g in self.groups if lo < g.step <= max(lo + 1, hi - tail) for ep in g.members]
        kept = [ep for ep in cohort if ep.state == "admitted"]
        selection = {"launched": len(cohort), "admitted": len(kept),
                     "launched_length_mean": statistics.fmean(ep.shape.policy_tokens for ep in cohort) if cohort else None,
                     "admitted_length_mean": statistics.fmean(ep.shape.policy_tokens for ep in kept) if kept else None,
                     "launched_reward_mean": statistics.fmean(ep.shape.reward for ep in cohort) if cohort else None,
                     "admitted_reward_mean": statistics.fmean(ep.shape.reward for ep in kept) if kept else None}
        return SimResult(
            config=self.cfg, steps=[{k: v for k, v in r.items() if k not in ("lengths", "rewards")} for r in rows],
            admitted_tokens_per_s=tokens / wall if wall else 0.0,
            step_s=wall / len(window) if window else 0.0, utilisation=util,
            queue_depth=statistics.fmean(r["queue_depth"] for r in window) if window else 0.0,
            lag_histogram=dict(sorted(lags.items())),
            admitted={"episodes": len(lengths), "length_mean": statistics.fmean(lengths) if lengths else None,
                      "reward_mean": statistics.fmean(rewards) if rewards else None},
            launched={"episodes": len(shapes),
                      "length_mean": statistics.fmean(s.policy_tokens for s in shapes) if shapes else None,
                      "reward_mean": statistics.fmean(s.reward for s in shapes) if shapes else None,
                      "selection": selection},
            window=(lo + 1, hi))


def simulate(workload: Workload, cfg: Config, *, steps: int = 30, warmup: int = 2, seeds: int = 3) -> SimResult:
    """The median (by admitted tokens/s) of `seeds` simulations with different episode orders."""
    results = [Simulation(workload, cfg, seed=s).run(steps, warmup) for s in range(seeds)]
    results.sort(key=lambda r: r.admitted_tokens_per_s)
    return results[len(results) // 2]
