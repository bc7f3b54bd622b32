"""The watchdog: one thread per rank that keeps the job from hanging or leaving orphans.

Every rank's watchdog beats its heartbeat. On the controller (rank 0) it also watches the
workers, in a constant number of store requests per heartbeat whatever the world size (every
rank's heartbeat counter in one read): an error report, a worker process that died (same host:
its pid; any host: a silent heartbeat), or a call past its deadline becomes the run's `failure`,
and it wakes the controller's main thread if that is waiting for a call to end. Ranks that fall
silent are named with their node; when every rank of a node is silent the node is named as lost.

Silence is judged by two clocks: a peer is silent when its heartbeat has not moved for
`heartbeat_timeout_s` AND the observer itself has read the store on schedule all that while
(at least timeout / interval of its own rounds since the peer last moved). An observer whose
own rounds stall (its store requests queued behind a burst of other ranks' traffic, or its
thread starved of CPU on a loaded host) sees every peer as quiet without evidence that any of
them stopped; it judges them once its reads are back on schedule. A dead peer is then named
after the timeout of the observer's working rounds: at most a few intervals late when the store
answers at once.

If the main thread is stuck inside a collective or a transfer (it cannot wait on the store
there), the watchdog prints the failure, sets the abort flag and ends the process after
`error_grace_s`. On a worker it watches the controller and the abort flag, and ends the process
when either says the run is over.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import threading
import time
from collections import defaultdict
from datetime import timedelta
from typing import Callable

import psutil

from hybridrl.distributed.control import ControlPlane, ErrorReport
from hybridrl.distributed.config import DistributedConfig

log = logging.getLogger(__name__)

EXIT_ABORTED = 1


def _hard_exit(message: str, code: int = EXIT_ABORTED) -> None:
    try:
        sys.stderr.write(message.rstrip() + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(code)


def _pid_dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class Watchdog(threading.Thread):
    def __init__(self, control: ControlPlane, cfg: DistributedConfig,
                 format_failure: Callable[[ErrorReport], str] = lambda r: r.message):
        super().__init__(name=f"hybridrl-watchdog-{control.rank}", daemon=True)
        self.control = control.clone()   # this thread's own store connection, whose requests time out:
        self.control.store.set_timeout(timedelta(seconds=max(60.0, 2 * cfg.heartbeat_timeout_s)))  # store lost
        self.cfg = cfg
        self.rank = control.rank
        self.world_size = control.world_size
        self.format_failure = format_failure
        self.failure: ErrorReport | None = None
        self._failure_at = 0.0
        self._failed = threading.Event()
        self._halt = threading.Event()
        self._lock = threading.Lock()
        # what the main thread is doing (set by the worker group)
        self.method = ""
        self.deadline: float | None = None
        self.timeout_s = 0.0
        self.call_seq: int | None = None   # the call whose end the controller's main thread waits for
        self.blocked = False            # main thread inside a section where it cannot wait on the store
        self.idle_in_serve = False      # worker main thread waiting for commands (exits by itself)
        self.leaving = False            # worker: SHUTDOWN acknowledged; the controller may exit before this rank
        self.finished = 0               # worker: the newest command it finished (sent with the heartbeat)
        self._count = 0
        self._woken: int | None = None
        self._errors_seen = 0
        self._born = time.monotonic()
        self._host = socket.gethostname()
        self._unregistered = list(range(1, self.world_size)) if self.rank == 0 else []
        self._watched: list[int] = []                     # registered workers, in rank order
        self._hosts: dict[int, str] = {}
        self._pids: dict[int, int] = {}                   # workers on this host
        self._beats: dict[int, tuple[int, float, int]] = {}   # rank -> (counter, when it last moved, round then)
        self._round = 0                                   # this watchdog's rounds that read the store
        self._rounds_needed = max(1, math.ceil(cfg.heartbeat_timeout_s / cfg.heartbeat_interval_s))
        self._finished: dict[int, int] = {}               # rank -> newest command it finished

    # ------------------------------------------------------------------ main-thread API

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)

    def set_failure(self, report: ErrorReport) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = report
                self._failure_at = time.monotonic()
                self._failed.set()

    def poll_failure(self) -> ErrorReport | None:
        with self._lock:
            return self.failure

    def wait_failure(self, timeout_s: float) -> ErrorReport | None:
        """The run's failure once the watchdog has one, or None after `timeout_s`."""
        self._failed.wait(timeout_s)
        return self.poll_failure()

    def nodes(self) -> dict[str, list[int]]:
        """Ranks by host, as registered (rank 0's view; the workers seen so far)."""
        by_host: dict[str, list[int]] = defaultdict(list)
        by_host[self._host].append(self.rank)
        for rank in sorted(self._hosts):
            by_host[self._hosts[rank]].append(rank)
        return dict(by_host)

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        interval = self.cfg.heartbeat_interval_s
        due = time.monotonic() + interval
        while not self._halt.wait(max(0.0, due - time.monotonic())):
            due = max(due + interval, time.monotonic())   # a fixed schedule; a late round does not shift it
            try:
                self._count += 1
                self.control.beat(self._count, self.finished)
                if self.rank == 0:
                    self._watch_workers()
                else:
                    self._watch_controller()
                self._round += 1
            except Exception as err:  # noqa: BLE001 - the store is gone: the controller is gone
                if self._halt.is_set():
                    return
                if self.rank == 0:
                    _hard_exit(f"hybridrl: rank 0 lost the control-plane store: {err}")
                _hard_exit(f"hybridrl: rank {self.rank}: the controller's store is unreachable ({err}); exiting")

    def _watch_workers(self) -> None:
        now = time.monotonic()
        total = self.control.num_errors()
        while self._errors_seen < total:
            report = self.control.error(self._errors_seen)
            if report is None:
                break
            self._errors_seen += 1
            self.set_failure(report)
        self._register(now)
        self._check_workers(now)
        if self.deadline is not None and time.time() > self.deadline:
            self.set_failure(self._timeout_report())
        with self._lock:
            failure, since = self.failure, self._failure_at
        if failure is None:
            return
        seq = self.call_seq
        if seq is not None and self._woken != seq and not self.blocked:
            self.control.wake(seq)          # the main thread waits for this call's end: end it now
            self._woken = seq
        if self.blocked and now - since > self.cfg.error_grace_s:
            message = self.format_failure(failure)
            self.control.abort(message)
            _hard_exit("hybridrl: the controller is blocked in a collective while the run failed; "
                       "aborting every rank.\n" + message)

    def _seen(self, rank: int, count: int, now: float) -> None:
        """A heartbeat counter read this round: its time and round are reset when it moved."""
        last = self._beats.get(rank)
        if last is None or count != last[0]:
            self._beats[rank] = (count, now, self._round)

    def _quiet_for(self, rank: int, now: float) -> float:
        """How long `rank` has been silent, as far as this watchdog has evidence: 0 until it has
        read the store on `heartbeat_timeout_s / heartbeat_interval_s` rounds since the rank last
        moved (see the module doc), the wall-clock time since then after that."""
        _, since, at_round = self._beats[rank]
        return now - since if self._round - at_round >= self._rounds_needed else 0.0

    def _timeout_report(self) -> ErrorReport:
        if self.blocked:
            return ErrorReport(0, self.method, "timeout",
                               f"call '{self.method}' exceeded its {self.timeout_s:g}s timeout "
                               "while the controller was blocked in a collective or transfer")
        seq = self.call_seq or 0        # as of the workers' last heartbeats
        late = [r for r in range(1, self.world_size) if self._finished.get(r, 0) < seq]
        return ErrorReport(late[0] if late else 0, self.method, "timeout",
                           f"call '{self.method}' exceeded its {self.timeout_s:g}s timeout; "
                           f"ranks still running: {late}")

    def _register(self, now: float) -> None:
        """Learn the hosts and pids of workers that registered since the last heartbeat."""
        if not self._unregistered:
            return
        new = self.control.registered(self._unregistered)
        if new:
            for rank, (host, pid) in self.control.processes(new).items():
                self._hosts[rank] = host
                if host == self._host:
                    self._pids[rank] = pid
                self._beats[rank] = (-1, now, self._round)
            self._unregistered = [r for r in self._unregistered if r not in set(new)]
            self._watched = sorted(self._hosts)
            if not self._unregistered:
                nodes = self.nodes()
                log.info("%d ranks on %d node(s): %s", self.world_size, len(nodes),
                         "; ".join(f"{host} {_ranks(ranks)}" for host, ranks in nodes.items()))
        if (self._unregistered and now - self._born > self.cfg.heartbeat_timeout_s
                and self._round >= self._rounds_needed):
            self.set_failure(ErrorReport(self._unregistered[0], self.method, "silent",
                                         f"{_ranks(self._unregistered)} never registered with the controller "
                                         f"within {self.cfg.heartbeat_timeout_s:g}s of its start"))

    def _check_workers(self, now: float) -> None:
        for rank, pid in self._pids.items():
            if _pid_dead(pid):
                self.set_failure(ErrorReport(rank, self.method, "died",
                                             f"rank {rank} (pid {pid} on {self._hosts[rank]}) died"))
                return
        beats = self.control.beats_of(self._watched)
        now = time.monotonic()                       # as of this read (the requests before it may have queued)
        for rank, (count, finished) in zip(self._watched, beats):
            self._finished[rank] = finished
            self._seen(rank, count, now)
        silent = [r for r in self._watched if self._quiet_for(r, now) > self.cfg.heartbeat_timeout_s]
        if silent:
            self.set_failure(self._silence_report(silent, now))

    def _silence_report(self, silent: list[int], now: float) -> ErrorReport:
        """Silent ranks by node; a node whose every rank stopped beating is named as lost (ranks
        that died together cross the timeout a heartbeat or two apart: those quiet for two
        heartbeats count with them)."""
        quiet = {r for r in self._watched if now - self._beats[r][1] > 2 * self.cfg.heartbeat_interval_s
                 and self._round - self._beats[r][2] >= 2}
        parts, named = [], []
        for host, ranks in self.nodes().items():
            lost = [r for r in ranks if r in silent]
            if not lost:
                continue
            longest = max(self._quiet_for(r, now) for r in lost)
            stopped = sorted(set(lost) | {r for r in ranks if r in quiet})
            named += stopped if stopped == ranks else lost
            if stopped == ranks:
                parts.append(f"node {host} lost: {_ranks(ranks)} (every rank on it) sent no heartbeat for "
                             f"{longest:.1f}s (distributed.heartbeat_timeout_s={self.cfg.heartbeat_timeout_s:g})")
            else:
                parts.append(f"{_ranks(lost)} on {host} sent no heartbeat for {longest:.1f}s")
        return ErrorReport(min(named), self.method, "silent", "; ".join(parts))

    def _watch_controller(self) -> None:
        if self.leaving:         # the run ended: the controller exits as soon as every rank acknowledged it
            return
        reason = self.control.aborted()
        if reason is not None:
            if not self.idle_in_serve:
                time.sleep(min(1.0, self.cfg.error_grace_s))
            _hard_exit(f"hybridrl: rank {self.rank} stopping: the run was aborted")
        self._check_controller(time.monotonic())
        if self.failure is not None:
            _hard_exit(f"hybridrl: rank {self.rank} stopping: {self.failure.message}")

    def _check_controller(self, now: float) -> None:
        count = self.control.beats(0)[0]
        now = time.monotonic()
        self._seen(0, count, now)
        quiet = self._quiet_for(0, now)
        if quiet > self.cfg.heartbeat_timeout_s:
            self.set_failure(ErrorReport(0, self.method, "silent",
                                         f"the controller (rank 0) sent no heartbeat for {quiet:.1f}s"))
            return
        if 0 not in self._pids:
            proc = self.control.process(0)
            if proc is None:
                return  # not registered yet
            self._pids[0] = proc[1] if proc[0] == self._host else -1   # another host: the heartbeat only
        if self._pids[0] > 0 and _pid_dead(self._pids[0]):
            self.set_failure(ErrorReport(0, self.method, "died", f"the controller (rank 0, pid {self._pids[0]}) died"))
