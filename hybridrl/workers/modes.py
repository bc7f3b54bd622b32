"""The colocated rank's mode state machine: training and generation time-share one device, and
every phase of a switch is timed with its memory (`Phases` times the phases of any rank).

    TRAIN --(offload optimizer/grads)--> RESHARD --(stream weights, publish)--> ROLLOUT
      ^                                                                             |
      +------------------(release KV cache, reload optimizer/grads)------------------+

A failed RESHARD returns to TRAIN (the engine keeps its previous version). Any other move raises
`IllegalTransition`. Each phase records wall time, bytes moved and peak memory.

Every phase of a switch (offload, publish, wake, sleep, reload) has a deadline (`hybrid.*_deadline_s`).
A switch begins with every rank's arrival (`Phases.arrive`: a barrier on the control plane's store,
bounded by the first phase's deadline, so a rank that stops coming is named instead of waited for
inside a collective); the barrier also carries each rank's vote on what the switch must do. Inside a
phase, the worker waits only in bounded ways: for the engine (`remaining()` bounds each await) or in
work that cannot be interrupted (a collective, an offload), which a backstop covers: past the deadline
plus a grace, the phase is reported as this rank's error and the run is aborted, so every rank exits.
A rank stuck inside a phase is thus named by its own backstop, while the others wait in the next
collective until the abort ends them. Either way the error names the rank, the phase and what it
waited for; the run resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import enum
import json
import statistics
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import torch

from hybridrl.telemetry import spans
from hybridrl.telemetry.timers import PeakMemory


class Mode(str, enum.Enum):
    TRAIN = "train"
    RESHARD = "reshard"
    ROLLOUT = "rollout"


_ALLOWED = {
    Mode.TRAIN: {Mode.RESHARD},
    Mode.RESHARD: {Mode.ROLLOUT, Mode.TRAIN},
    Mode.ROLLOUT: {Mode.TRAIN},
}


class IllegalTransition(RuntimeError):
    pass


class PhaseTimeout(RuntimeError):
    """A phase of a mode switch ran past its deadline; the message names the rank, phase and what it waited for."""


class Arrivals:
    """A barrier on a key-value store (the control plane's) that gives up at a deadline and says who is
    missing. Nothing polls: each rank marks itself arrived and counts itself in; the last one sets the
    barrier's key, which every other rank waits for in the store's own blocking wait (answered the
    moment it is set), bounded by the phase's deadline. A run aborted during the wait reaches the rank
    through its watchdog, which watches the abort flag and ends the process.

    On a switch's path a barrier costs one store round trip (the count) and, but for the last rank to
    arrive, the wait; setting a key needs no answer. A rank's arrival key holds its vote (`wait(vote=)`,
    JSON), which `votes` reads for every rank in one more round trip: a decision every rank takes
    together at the price of a barrier it pays anyway, not of a collective. Deleting the keys of old
    barriers (`forget`) is a round trip per key, so it runs on a background thread, `sweep_delay_s`
    after the first key of a batch was handed over: by then the switch that queued them is over, and
    its phases did not share the interpreter with the deletions."""

    def __init__(self, store, rank: int, ranks: Sequence[int], aborted: Callable[[], str | None] = lambda: None,
                 sweep_delay_s: float = 0.05):
        self.store, self.rank, self.ranks, self.aborted = store, rank, list(ranks), aborted
        self.sweep_delay_s = sweep_delay_s
        self._stale: list[str] = []                  # keys to delete, in order
        self._busy = False
        self._cond = threading.Condition()
        self._janitor: threading.Thread | None = None

    def wait(self, key: str, deadline: float | None, *, vote: Any = None) -> list[int]:
        """Mark this rank arrived at `key` (with its `vote`, JSON); wait for the others until `deadline`
        (time.monotonic()). Returns the ranks still missing (empty when all arrived)."""
        self.store.set(f"arrive/{key}/{self.rank}", json.dumps(vote).encode())
        if self.store.add(f"arrive/{key}/count", 1) >= len(self.ranks):
            self.store.set(f"arrive/{key}/all", b"1")
            return []
        reason = self.aborted()
        if reason is not None:
            raise RuntimeError(f"rank {self.rank}: the run was aborted while waiting at {key}: {reason}")
        while True:
            try:
                if deadline is None:
                    self.store.wait([f"arrive/{key}/all"])
                else:
                    left = max(deadline - time.monotonic(), 0.001)
                    self.store.wait([f"arrive/{key}/all"], timedelta(seconds=left))
                return []
            except RuntimeError:                 # the store's wait timed out (DistStoreError)
                # ...which can be a fraction of a millisecond early (the store counts whole
                # milliseconds): the barrier ends at its deadline, not before
                if deadline is not None and time.monotonic() < deadline:
                    continue
                return [r for r in self.ranks if not self.store.check([f"arrive/{key}/{r}"])]

    def votes(self, key: str) -> dict[int, Any]:
        """Every rank's vote at barrier `key`, {rank: vote} (read once all have arrived)."""
        values = self.store.multi_get([f"arrive/{key}/{r}" for r in self.ranks])
        return {r: json.loads(v) for r, v in zip(self.ranks, values)}

    def forget(self, key: str) -> None:
        """Drop this rank's keys of a barrier that no rank reads any more (the first rank drops the shared
        ones), on the background thread."""
        keys = [f"arrive/{key}/{self.rank}"]
        if self.ranks and self.rank == self.ranks[0]:
            keys += [f"arrive/{key}/count", f"arrive/{key}/all"]
        with self._cond:
            self._stale.extend(keys)
            if self._janitor is None:
                self._janitor = threading.Thread(target=self._sweep, name="hybridrl-arrivals-janitor", daemon=True)
                self._janitor.start()
            self._cond.notify()

    def settle(self, timeout: float = 10.0) -> bool:
        """Wait until every key handed to `forget` is deleted (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._stale and not self._busy, timeout)

    def _sweep(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._stale))
                self._busy = True
            time.sleep(self.sweep_delay_s)           # the rest of the switch's keys join this batch
            with self._cond:
                keys, self._stale = self._stale, []
            for k in keys:
                try:
                    self.store.delete_key(k)
                except Exception:  # noqa: BLE001 - best effort: a key left behind costs a few bytes
                    pass
            with self._cond:
                self._busy = False
                self._cond.notify_all()


class Backstop:
    """Calls `on_overrun(message)` when an armed deadline passes before `disarm`: a phase stuck where
    nothing can interrupt it (a collective, a copy). One thread for every phase of a rank, started on
    the first `arm`: arming a phase takes a lock (and a wake-up when the thread must wait less), not
    a thread start per phase."""

    def __init__(self, on_overrun: Callable[[str], None]):
        self.on_overrun = on_overrun
        self._cond = threading.Condition()
        self._armed: tuple[float, str] | None = None     # (monotonic deadline, message)
        self._waiting_until: float | None = None        # the deadline the thread sleeps towards (None: idle)
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, message: str) -> None:
        deadline = time.monotonic() + seconds
        with self._cond:
            self._armed = (deadline, message)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="hybridrl-phase-backstop", daemon=True)
                self._thread.start()
            elif self._waiting_until is None or deadline < self._waiting_until:
                self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None          # the thread finds nothing armed when it next wakes

    def _watch(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._armed is None:
                        self._waiting_until = None
                        self._cond.wait()
                        continue
                    deadline, message = self._armed
                    if time.monotonic() >= deadline:
                        self._armed = None
                        break
                    self._waiting_until = deadline
                    self._cond.wait(deadline - time.monotonic())
            self.on_overrun(message)


@dataclass
class PhaseRecord:
    seconds: float
    bytes_moved: int
    peak_mem_bytes: int
    arrival_s: float = 0.0          # waiting for the other ranks at the switch's arrival (before `seconds`)


class Phases:
    """The timed phases of one rank (seconds, bytes moved, peak memory), with deadlines, arrival
    barriers and the backstop for the phases of a switch. A rank that never switches modes (a
    placement whose roles are apart) has phases but no mode: `require` then holds for any mode."""

    mode: Mode | None = None

    def __init__(self, device: torch.device | None = None, *, rank: int = 0,
                 deadlines: Mapping[str, float] | None = None, arrivals: Arrivals | None = None,
                 on_overrun: Callable[[str], None] | None = None, overrun_grace_s: float = 2.0):
        self.device = device
        self.history: dict[str, list[PhaseRecord]] = defaultdict(list)
        self.rank = rank
        self.deadlines = dict(deadlines or {})
        self.arrivals = arrivals
        self.on_overrun = on_overrun
        self.overrun_grace_s = overrun_grace_s
        self._backstop = Backstop(on_overrun) if on_overrun is not None else None
        self.switches = 0                  # mode switches begun (SPMD: the same count on every rank)
        self._current: tuple[str, float | None] | None = None     # (phase, monotonic deadline)
        self._arrival: tuple[str, float] | None = None             # (first phase, seconds waited at `arrive`)

    def require(self, *modes: Mode) -> None:
        """Refuse an operation outside `modes` (a rank without a mode machine allows every operation)."""
        if self.mode is not None and self.mode not in modes:
            raise IllegalTransition(f"operation needs mode {' or '.join(m.value for m in modes)}; "
                                    f"the worker is in {self.mode.value}")

    def arrive(self, phase: str, *, vote: Any = None) -> dict[int, Any]:
        """The start of a switch: mark this rank arrived and wait for every rank (bounded by the deadline of
        `phase`, the switch's first phase, whose record keeps the wait as `arrival_s`). Returns every rank's
        `vote` (JSON), {rank: vote}: what the ranks decide on together, with no collective ({} without a
        vote). Without arrivals (one rank, or a phase without a deadline), only this rank's own."""
        limit = self.deadlines.get(phase)
        if self.arrivals is None or not limit:
            return {self.rank: vote} if vote is not None else {}
        deadline = time.monotonic() + limit
        self._current = (phase, deadline)
        try:
            arrived = time.perf_counter()
            key = f"{self.switches}/{phase}"
            missing = self.arrivals.wait(key, deadline, vote=vote)
            if missing:
                raise PhaseTimeout(self.timeout_message(f"rank(s) {missing} to arrive"))
            votes = self.arrivals.votes(key) if vote is not None else {}
            self._arrival = (phase, time.perf_counter() - arrived)
            # every rank has passed the barrier of two switches ago: its key is no longer read
            self.arrivals.forget(f"{self.switches - 2}/{phase}")
            return votes
        finally:
            self._current = None

    @contextlib.contextmanager
    def phase(self, name: str, *, waits_for: str = "its work"):
        """Time a phase; the body sets `rec.bytes_moved`. Yields a mutable record.

        A phase with a deadline is a phase of a mode switch, which every rank runs: its deadline bounds
        the engine's awaits (`bounded`) and arms the backstop. Phases without one (generation, a train
        step) are only timed: ranks may skip them (a rank that holds no engine). The switch's arrival
        (`arrive`) is timed with its first phase."""
        rec = PhaseRecord(0.0, 0, 0)
        if self._arrival is not None and self._arrival[0] == name:
            rec.arrival_s, self._arrival = self._arrival[1], None
        limit = self.deadlines.get(name)
        deadline = time.monotonic() + limit if limit else None
        self._current = (name, deadline)
        backstop = self._backstop if limit else None
        if backstop is not None:
            backstop.arm(limit + self.overrun_grace_s,
                         self.timeout_message(waits_for) + " (stuck where it cannot be interrupted)")
        try:
            if self.device is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            with PeakMemory(self.device) as peak:
                start = time.perf_counter()
                yield rec
                if self.device is not None and self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                rec.seconds = time.perf_counter() - start
            rec.peak_mem_bytes = peak.peak_bytes
            self.history[name].append(rec)
            spans.record_phase(name, rec.seconds, arrival_s=rec.arrival_s, bytes=rec.bytes_moved)
        finally:
            self._current = None
            if backstop is not None:
                backstop.disarm()

    def remaining(self) -> float | None:
        """Seconds left before the current phase's deadline (None: no deadline)."""
        if self._current is None or self._current[1] is None:
            return None
        return max(0.0, self._current[1] - time.monotonic())

    def bounded(self, run: Callable, coro, waits_for: str):
        """`run(coro)` (an engine coroutine, awaited where its loop runs) within what is left of the current
        phase's deadline; past it, `PhaseTimeout` naming what it waited for."""
        import asyncio

        remaining = self.remaining()
        try:
            return run(asyncio.wait_for(coro, remaining) if remaining is not None else coro)
        except asyncio.TimeoutError:
            raise PhaseTimeout(self.timeout_message(waits_for)) from None

    def timeout_message(self, waits_for: str) -> str:
        name = self._current[0] if self._current else "?"
        return (f"rank {self.rank}: phase '{name}' of a mode switch exceeded its {self.deadlines.get(name, 0):g}s "
                f"deadline (hybrid.{name}_deadline_s) waiting for {waits_for}")

    def last(self) -> dict[str, dict[str, float]]:
        return {name: {"seconds": recs[-1].seconds, "bytes": recs[-1].bytes_moved,
                       "peak_mem_bytes": recs[-1].peak_mem_bytes, "arrival_s": recs[-1].arrival_s}
                for name, recs in self.history.items() if recs}

    def summary(self) -> dict[str, dict[str, float]]:
        """Median seconds / bytes and max peak memory of every phase so far."""
        return {name: {"median_s": statistics.median(r.seconds for r in recs),
                       "bytes": int(statistics.median(r.bytes_moved for r in recs)),
                       "peak_mem_bytes": max(r.peak_mem_bytes for r in recs), "count": len(recs)}
                for name, recs in self.history.items() if recs}


class ModeMachine(Phases):
    """The colocated rank's mode (TRAIN, RESHARD, ROLLOUT) and its phases; illegal moves raise."""

    def __init__(self, device: torch.device | None = None, start: Mode = Mode.TRAIN, **kwargs):
        super().__init__(device, **kwargs)
        self.mode = start

    def to(self, target: Mode) -> None:
        if target not in _ALLOWED[self.mode]:
            raise IllegalTransition(f"{self.mode.value} -> {target.value} is not a legal mode switch")
        self.mode = target
