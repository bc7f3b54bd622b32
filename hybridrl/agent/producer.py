"""`Producer`: a rollout rank's continuous collection (the disaggregated placement).

The rank's engine, agent runner and tools live on one event loop that runs in a thread of its
own (`LoopThread`), so generation goes on while the rank's main thread answers the controller:
grants of new groups, takes of complete ones, weight publications.

    grant(groups, floor)   whole groups (every attempt of an instance) join the waiting line with
                           their `floor`: the oldest policy version their tokens may come from
    the launcher           starts the waiting groups in order, each once the engine serves a version
                           >= its floor (with a lag bound of 0 a group waits for the next update;
                           with 1 it starts on the version being trained on), at a grant, a take or
                           a quiesce
    quiesce()              waits until no group runs (before a publication and a read of counters)
    take(group_ids)        blocks until those groups are complete and hands them over

Determinism: what a group generates must not depend on timing, so every change of what runs
happens at a point the controller's sequential program fixes, never at a time. `grant` and
`lower_floor` return once the loop has applied them (the groups they admit start then, on the
version served then), and nothing starts on its own when a new version arrives: a waiting group
starts at the next `grant` or `take`. Before a publication (`quiesce`) every group that can run on
the version served now runs to its end, so a group's tokens all come from the version it started
on and no publication lands in the middle of a batch. Within that, the engine's loop driver, the
agent loop and in-process tools run on one event loop in an order fixed by the events themselves.

What the producer counts: `idle_s` (the engine had no episode of this producer to run),
`floor_waits` (groups that waited for a newer version before starting), `policy_tokens` of the
episodes that ended, groups waiting, running and complete.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Sequence

from hybridrl.data.trajectory import Trajectory


class LoopThread:
    """An asyncio loop running forever in a daemon thread; `run(coro)` waits for a result from any
    other thread."""

    def __init__(self, name: str = "hybridrl-producer"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        import torch

        torch.set_grad_enabled(False)        # generation only, in this thread
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the loop's thread (reads of state the loop mutates)."""
        async def go():
            return fn(*args)
        return self.run(go())

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)


@dataclass
class _Group:
    group_id: str
    attempts: list[tuple[Any, int, str]]       # (instance, attempt, group id)
    floor: int
    granted_at: float = field(default_factory=time.monotonic)
    waited: bool = False                       # had to wait for a newer policy version


class Producer:
    """Granted groups of one rollout rank, run continuously on `runner`'s engine in `loop` (a loop
    running in another thread). `grant`, `lower_floor`, `take` and `stats` are called from other
    threads."""

    def __init__(self, runner: Any, task: Any, loop: asyncio.AbstractEventLoop):
        self.runner, self.task, self.loop = runner, task, loop
        self._waiting: list[_Group] = []                          # granted, not started (loop thread)
        self._members: dict[str, list[Trajectory]] = defaultdict(list)
        self._running: dict[str, int] = {}                        # group -> episodes still running
        self._complete: dict[str, list[Trajectory]] = {}          # guarded by _cond
        self._cond = threading.Condition()
        self._busy = 0                                            # groups running (guarded by _cond)
        self._error: BaseException | None = None
        self.started = time.monotonic()
        self._idle_since: float | None = self.started
        self._counts = {"idle_s": 0.0, "floor_waits": 0, "launched_groups": 0, "completed_groups": 0,
                        "launched_episodes": 0, "policy_tokens": 0}

    # ------------------------------------------------------------------ from the controller's thread

    def grant(self, groups: Sequence[Sequence[tuple[Any, int, str]]], floor: int,
              before: Callable[[], Coroutine] | None = None) -> None:
        """Each item: one group's attempts (instance, attempt, group id). Returns once the loop has
        queued them and started those the served version admits. `before()` is awaited on the loop just
        before, at the same point of the engine's steps (what a hold on the next update counts from)."""
        items = [_Group(g[0][2], list(g), floor) for g in groups if g]

        async def go():
            if before is not None:
                await before()
            self._add(items)
        asyncio.run_coroutine_threadsafe(go(), self.loop).result()

    def running(self) -> bool:
        """Some group runs (read on the loop's thread)."""
        return bool(self._running)

    def lower_floor(self, floor: int) -> None:
        """No waiting group needs a version newer than `floor` (the controller's admission bound now);
        returns once the groups this admits have started."""
        self._on_loop(self._lower, floor)

    def poke(self) -> None:
        """Start what the served version admits now (returns once started)."""
        self._on_loop(self._launch)

    def quiesce(self, *, poll_s: float = 0.5, aborted: Callable[[], str | None] = lambda: None,
                start: bool = True) -> None:
        """Start what the served version admits (unless not `start`), then wait until no group runs: before a
        publication (every token of a group comes from the version it started on) and before counters are read."""
        if start:
            self.poke()
        with self._cond:
            while self._busy:
                self._raise_if_failed(aborted, "running groups to end")
                self._cond.wait(poll_s)
            self._raise_if_failed(aborted, "running groups to end")

    def _on_loop(self, fn: Callable, *args: Any) -> None:
        async def go():
            fn(*args)
        asyncio.run_coroutine_threadsafe(go(), self.loop).result()

    def _raise_if_failed(self, aborted: Callable[[], str | None], what: str) -> None:
        """(holding _cond)"""
        if self._error is not None:
            raise RuntimeError(f"the rollout producer failed: {self._error!r}") from self._error
        reason = aborted()
        if reason is not None:
            raise RuntimeError(f"the run was aborted while waiting for {what}: {reason}")

    def take(self, group_ids: Sequence[str], *, poll_s: float = 0.5,
             aborted: Callable[[], str | None] = lambda: None) -> list[Trajectory]:
        """The trajectories of `group_ids` (each group whole, attempts in order), once all are complete."""
        wanted = list(dict.fromkeys(group_ids))
        with self._cond:
            while True:
                self._raise_if_failed(aborted, "groups")
                if all(g in self._complete for g in wanted):
                    return [t for g in wanted for t in self._complete.pop(g)]
                self._cond.wait(poll_s)

    def stats(self) -> dict[str, float]:
        """Counters and gauges, read on the loop's thread."""
        async def read():
            idle = self._counts["idle_s"] + (time.monotonic() - self._idle_since if self._idle_since else 0.0)
            with self._cond:
                complete = len(self._complete)
            return {**self._counts, "idle_s": idle, "clock": time.monotonic(), "waiting_groups": len(self._waiting),
                    "running_groups": len(self._running), "complete_groups": complete,
                    "running_episodes": sum(self._running.values())}
        return asyncio.run_coroutine_threadsafe(read(), self.loop).result()

    def pending(self) -> list[str]:
        """Groups granted and not yet taken (waiting, running or complete)."""
        async def read():
            with self._cond:
                return sorted({*(g.group_id for g in self._waiting), *self._running, *self._complete})
        return asyncio.run_coroutine_threadsafe(read(), self.loop).result()

    # ------------------------------------------------------------------ on the loop's thread

    def _add(self, items: list[_Group]) -> None:
        self._waiting += items
        self._launch()

    def _lower(self, floor: int) -> None:
        for g in self._waiting:
            g.floor = min(g.floor, floor)
        self._launch()

    def _launch(self) -> None:
        """Start waiting groups in grant order while the engine's version admits them."""
        version = self.runner.engine.policy_version
        while self._waiting and self._waiting[0].floor <= version:
            group = self._waiting.pop(0)
            if group.waited:
                self._counts["floor_waits"] += 1
            self._start(group)
        for g in self._waiting:
            g.waited = True

    def _start(self, group: _Group) -> None:
        if self._idle_since is not None:
            self._counts["idle_s"] += time.monotonic() - self._idle_since
            self._idle_since = None
        self._running[group.group_id] = len(group.attempts)
        with self._cond:
            self._busy += 1
        self._counts["launched_groups"] += 1
        self._counts["launched_episodes"] += len(group.attempts)
        for inst, attempt, group_id in group.attempts:
            task = self.loop.create_task(self.runner.admit(inst, self.task, attempt, group_id, None, None))
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        try:
            traj = task.result()                    # run_episode never raises for the episode itself
        except BaseException as err:  # noqa: BLE001 - a bug in the loop: fail the next take
            with self._cond:
                self._error = err
                self._cond.notify_all()
            return
        group = traj.group_id
        self._counts["policy_tokens"] += traj.num_policy_tokens
        self._members[group].append(traj)
        self._running[group] -= 1
        if self._running[group]:
            return
        del self._running[group]
        members = sorted(self._members.pop(group), key=lambda t: t.attempt)
        self._counts["completed_groups"] += 1
        if not self._running and self._idle_since is None:
            self._idle_since = time.monotonic()
        with self._cond:
            self._complete[group] = members
            self._busy -= 1
            self._cond.notify_all()
