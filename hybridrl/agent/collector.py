"""`PartialCollector`: one rollout rank's episodes that outlive a step (partial rollouts).

Per step (`collect`), on the rank that owns an engine:

    launch the step's new groups (whole groups: a group never spans engines)
    open the gate; run the event loop in slices: until an episode ends or `POLL_STEPS` engine
    steps have run (the native engine's loop driver; other engines: `poll_s` seconds)
        after each slice every rank adds up its complete groups (all-reduce; ranks without an
        engine add 0): stop when `quorum` groups are complete, the deadline has passed, or no
        episode is still running anywhere
    close the gate, interrupt the requests in flight at a token boundary (`PauseGate`)
    return the complete groups; the other episodes stay here, paused, with everything they hold

At a checkpoint (`hand_over`) the held episodes settle (each ends or waits at the closed gate) and
leave as data: the ended members, the episodes paused mid-turn saved whole (`agent/saved.py`), the
attempts that cannot be saved as their prompts; the next `collect(held=...)` restores them.

A group is returned only when all its members have ended, so a group baseline never sees a
subset chosen by completion time. Members that ended wait here for the rest of their group.
The returned trajectories carry, per token, the version that produced it and its behaviour
logprob; a continued episode therefore holds segments of several versions, never relabelled.

Determinism: which groups a step returns and where the others are interrupted must not depend on
timing. A slice measured in seconds made both depend on the machine's load (how many tokens fit in
50 ms), so with the native engine's loop driver a slice is measured in engine steps: the engine, the
agent loop and in-process tools run on one event loop in an order the events fix, each rank's slices
hold the same steps in every run, and the quorum is counted at the same points. What still follows
the clock: `deadline_s`, tools and environments that wait on other processes, engines whose steps run
in a thread of their own (CUDA) or another process (SGLang, vLLM).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from hybridrl.agent.pause import PauseGate
from hybridrl.agent.saved import HeldGroup, SavedEpisode, saveable
from hybridrl.algo.filters import informative_groups
from hybridrl.data.trajectory import Trajectory

POLL_STEPS = 8            # engine steps per slice: the quorum is counted this often (the loop driver)
IDLE_SPINS = 64           # loop passes with an idle engine before a slice waits on the clock instead


@dataclass
class CollectStats:
    launched: int = 0            # episodes launched this step
    returned: int = 0            # episodes returned (members of complete groups)
    interrupted: int = 0         # requests aborted at the end of this step's window
    live: int = 0                # episodes still running (paused) after this step
    live_tokens: int = 0         # policy tokens those episodes hold (carried into the next step)
    waiting: int = 0             # ended episodes whose group is not complete yet
    polls: int = 0
    seconds: float = 0.0
    stopped_by: str = ""         # quorum | deadline | drained
    live_groups: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"launched": self.launched, "returned": self.returned, "interrupted": self.interrupted,
                "live": self.live, "live_tokens": self.live_tokens, "waiting": self.waiting, "polls": self.polls, "seconds": self.seconds,
                "stopped_by": self.stopped_by, "live_groups": list(self.live_groups)}


class StepClock(Protocol):
    """An engine whose steps run on the caller's event loop (the native engine's loop driver; its row's
    `step_clock`): a number of steps is then a point every run reaches alike."""

    def steps(self) -> int: ...

    def has_work(self) -> bool: ...


class PartialCollector:
    """Episodes of one engine kept across steps. `sum_over_ranks(values)` adds a list of floats over
    every rank (a collective: every rank calls `collect` the same number of times). `clock`: the
    engine's step clock, or None (slices measured in seconds)."""

    def __init__(self, runner: Any, task: Any, loop: asyncio.AbstractEventLoop, *, group_size: int,
                 sum_over_ranks: Callable[[list[float]], list[float]], owns_engine: bool = True,
                 clock: StepClock | None = None):
        self.runner, self.task, self.loop = runner, task, loop
        self.clock = clock
        self.group_size = group_size
        self.sum_over_ranks = sum_over_ranks
        self.owns_engine = owns_engine
        self.gate = PauseGate(runner.engine)
        self.gate.close()                                   # nothing runs between steps
        self.live: dict[asyncio.Task, str] = {}             # task -> group id
        self.members: dict[str, list[Trajectory]] = defaultdict(list)   # ended members per group
        self.expected: dict[str, int] = {}                  # group id -> members launched
        self.attempts: dict[asyncio.Task, tuple[Any, int, str]] = {}    # task -> (instance, attempt, group id)

    # ------------------------------------------------------------------ one step

    def collect(self, attempts: Sequence[tuple[Any, int, str]], *, quorum: int, deadline_s: float = 0.0,
                poll_s: float = 0.05, temperature: float | None = None, informative_only: bool = False,
                held: Sequence[HeldGroup] = ()) -> tuple[list[Trajectory], CollectStats]:
        """Launch `attempts` (instance, attempt, group id) and run until `quorum` complete groups exist
        over all ranks (or the deadline / nothing left to run); returns this rank's complete groups.
        `informative_only`: the quorum counts only groups whose rewards are not all equal. `held`: groups
        handed over at a checkpoint (`hand_over`), taken back first."""
        stats = CollectStats(launched=len(attempts) if self.owns_engine else 0)
        started = time.monotonic()
        if self.owns_engine:
            self._take_back(held, temperature)
            for inst, attempt, group_id in attempts:
                self.expected[group_id] = self.expected.get(group_id, 0) + 1
                self._start(inst, attempt, group_id, temperature)
        self.gate.open()
        while True:
            if self.live:
                self.loop.run_until_complete(self._slice(poll_s))
            else:
                time.sleep(min(poll_s, 0.01))
            self._harvest()
            stats.polls += 1
            late = deadline_s > 0 and time.monotonic() - started >= deadline_s
            counted = self._complete_groups(informative_only)
            complete, live, deadline = self.sum_over_ranks([float(len(counted)),
                                                            float(len(self.live)), float(late)])
            if complete >= quorum or deadline > 0 or live == 0:
                stats.stopped_by = "quorum" if complete >= quorum else "deadline" if deadline > 0 else "drained"
                break
        self.gate.close()
        # with a step clock, the aborts are retried pass by pass (a pause of 5 ms would let the engine run a
        # number of steps that depends on the machine for a request that reached it between two aborts)
        poll = 0.0 if self.clock is not None else 0.005
        stats.interrupted = self.loop.run_until_complete(self.gate.quiesce(poll_s=poll))
        self._harvest()
        out = []
        for group_id in self._complete_groups():
            out += sorted(self.members.pop(group_id), key=lambda t: t.attempt)
            del self.expected[group_id]
        stats.returned = len(out)
        stats.live = len(self.live)
        stats.live_tokens = sum(ep.live_policy_tokens() for ep in self.gate.running.values())
        stats.waiting = sum(len(m) for m in self.members.values())
        stats.live_groups = sorted(set(self.live.values()))
        stats.seconds = time.monotonic() - started
        return out, stats

    def _start(self, inst: Any, attempt: int, group_id: str, temperature: float | None,
               saved: SavedEpisode | None = None) -> None:
        coro = self.runner.admit(inst, self.task, attempt, group_id, None, temperature, self.gate, saved)
        task = self.loop.create_task(coro)
        self.live[task] = group_id
        self.attempts[task] = (inst, attempt, group_id)

    async def _slice(self, poll_s: float) -> None:
        """Run the held episodes until one ends or `POLL_STEPS` engine steps have run. Without a step
        clock (`StepClock`), or while every episode waits outside the engine (a tool in another
        process), until one ends or `poll_s` seconds have passed."""
        tasks = list(self.live)
        clock = self.clock
        if clock is None:
            await asyncio.wait(tasks, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
            return
        target, idle = clock.steps() + POLL_STEPS, 0
        while clock.steps() < target and not any(t.done() for t in tasks):
            idle = idle + 1 if not clock.has_work() else 0
            if idle > IDLE_SPINS:
                await asyncio.wait(tasks, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)
                return
            await asyncio.sleep(0)

    def _harvest(self) -> None:
        for task in [t for t in self.live if t.done()]:
            group_id = self.live.pop(task)
            del self.attempts[task]
            self.members[group_id].append(task.result())    # run_episode never raises for the episode

    def _complete_groups(self, informative_only: bool = False) -> list[str]:
        complete = [g for g, m in self.members.items() if len(m) == self.expected[g]]
        if not informative_only:
            return complete
        signal = informative_groups([t for g in complete for t in self.members[g]])
        return [g for g in complete if g in signal]

    # ------------------------------------------------------------------ at a checkpoint

    def hand_over(self, poll_s: float = 0.01) -> list[HeldGroup]:
        """Everything this rank holds, as data: every group launched and not returned, with its members that
        ended, its episodes saved mid-turn (`agent/saved.py`) and the attempts to run again from the prompt
        (those that cannot be saved). The episodes' tasks are cancelled; `collect(held=...)` restores them.
        First the held episodes settle, with the gate closed: each runs until it ends or waits at the
        gate (a tool call in progress returns), so that what is saved is a point the events fix; the same
        in the run that goes on and in one resumed from the checkpoint."""
        if not self.owns_engine or not self.expected:
            return []
        if type(self.runner).SAVES_EPISODES:                # (other front ends' episodes leave as their prompts)
            self.loop.run_until_complete(self._settle(poll_s))
        self._harvest()
        saved: dict[str, list[SavedEpisode]] = defaultdict(list)
        again: dict[str, list[tuple[Any, int]]] = defaultdict(list)
        for inst, attempt, group_id in sorted(self.attempts.values(), key=lambda a: (a[2], a[1])):
            ep = self._episode(group_id, attempt)
            if ep is not None and saveable(self.runner, ep):
                saved[group_id].append(SavedEpisode.of(ep))
            else:
                again[group_id].append((inst, attempt))
        held = [HeldGroup(g, self.expected[g], sorted(self.members.get(g, []), key=lambda t: t.attempt),
                          saved.get(g, []), again.get(g, [])) for g in sorted(self.expected)]
        self.close()                                        # the tasks cancelled; the gate stays closed
        self.members.clear()
        self.expected.clear()
        return held

    async def _settle(self, poll_s: float) -> None:
        """Run the loop until every held episode has ended or waits at the (closed) gate."""
        spins = 0
        while True:
            running = [t for t in self.live if not t.done()]
            parked = sum(1 for ep in self.gate.running.values() if any(p.parked for p in ep.turns_open))
            if len(running) <= parked:
                return
            spins += 1
            if spins < IDLE_SPINS:
                await asyncio.sleep(0)
            else:                   # waiting on another process (a tool, an environment): the clock
                await asyncio.wait(running, timeout=poll_s, return_when=asyncio.FIRST_COMPLETED)

    def _episode(self, group_id: str, attempt: int) -> Any:
        for ep in self.gate.running.values():
            if ep.traj.group_id == group_id and ep.traj.attempt == attempt:
                return ep
        return None

    def _take_back(self, held: Sequence[HeldGroup], temperature: float | None) -> None:
        """Restore groups handed over at a checkpoint: saved episodes first, in order, then attempts run
        again from their prompt."""
        for group in held:
            self.expected[group.group_id] = group.expected
            if group.ended:
                self.members[group.group_id] = list(group.ended)
        for group in held:
            for saved in group.saved:
                self._start(saved.instance, saved.traj.attempt, group.group_id, temperature, saved)
        for group in held:
            for inst, attempt in group.again:
                self._start(inst, attempt, group.group_id, temperature)

    def pending_groups(self) -> list[str]:
        """Groups launched here and not yet returned (running, paused or partly ended)."""
        return sorted(self.expected)

    def close(self) -> None:
        """Cancel the paused episodes (their environment sessions close)."""
        self.gate.stop()
        for task in list(self.live):
            task.cancel()
        if self.live:
            self.loop.run_until_complete(asyncio.gather(*self.live, return_exceptions=True))
        self.live.clear()
        self.attempts.clear()

