"""The watchdog: one thread per rank that keeps the job from hanging or leaving orphans.

Every rank's watchdog beats its heartbeat. On the controller (rank 0) it also watches the
workers: an error report, a worker process that died (same host: its pid; any host: a silent
heartbeat), or a call past its deadline becomes the run's `failure`. The controller's main
thread raises it when it next polls; if the main thread is stuck inside a collective or a
transfer (it cannot poll there), the watchdog prints the failure, sets the abort flag and ends
the process after `error_grace_s`. On a worker it watches the controller and the abort flag,
and ends the process when either says the run is over.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
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


class Watchdog(threading.Thread):
    def __init__(self, control: ControlPlane, cfg: DistributedConfig,
                 format_failure: Callable[[ErrorReport], str] = lambda r: r.message):
        super().__init__(name=f"hybridrl-watchdog-{control.rank}", daemon=True)
        self.control = control.clone()   # this thread's own store connection
        self.cfg = cfg
        self.rank = control.rank
        self.world_size = control.world_size
        self.format_failure = format_failure
        self.failure: ErrorReport | None = None
        self._failure_at = 0.0
        self._halt = threading.Event()
        self._lock = threading.Lock()
        # what the main thread is doing (set by the worker group)
        self.method = ""
        self.deadline: float | None = None
        self.timeout_s = 0.0
        self.blocked = False            # main thread inside a section where it cannot poll
        self.idle_in_serve = False      # worker main thread waiting for commands (exits by itself)
        self._errors_seen = 0
        self._beats: dict[int, tuple[int, float]] = {}
        self._host = socket.gethostname()
        self._pids: dict[int, int] = {}

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

    def poll_failure(self) -> ErrorReport | None:
        with self._lock:
            return self.failure

    # ------------------------------------------------------------------ the thread

    def run(self) -> None:
        interval = self.cfg.heartbeat_interval_s
        while not self._halt.wait(interval):
            try:
                self.control.beat()
                if self.rank == 0:
                    self._watch_workers()
                else:
                    self._watch_controller()
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
        for r in range(1, self.world_size):
            self._check_alive(r, now)
        if self.blocked and self.deadline is not None and time.time() > self.deadline:
            # (when the main thread is polling, it reports the timeout itself, with the late ranks)
            self.set_failure(ErrorReport(0, self.method, "timeout",
                                         f"call '{self.method}' exceeded its {self.timeout_s:g}s timeout "
                                         "while the controller was blocked in a collective or transfer"))
        with self._lock:
            failure, since = self.failure, self._failure_at
        if failure is not None and self.blocked and now - since > self.cfg.error_grace_s:
            message = self.format_failure(failure)
            self.control.abort(message)
            _hard_exit("hybridrl: the controller is blocked in a collective while the run failed; "
                       "aborting every rank.\n" + message)

    def _watch_controller(self) -> None:
        reason = self.control.aborted()
        if reason is not None:
            if not self.idle_in_serve:
                time.sleep(min(1.0, self.cfg.error_grace_s))
            _hard_exit(f"hybridrl: rank {self.rank} stopping: the run was aborted")
        self._check_alive(0, time.monotonic())
        if self.failure is not None:
            _hard_exit(f"hybridrl: rank {self.rank} stopping: {self.failure.message}")

    def _check_alive(self, rank: int, now: float) -> None:
        count = self.control.beats(rank)
        last = self._beats.get(rank)
        if last is None or count != last[0]:
            self._beats[rank] = (count, now)
        elif now - last[1] > self.cfg.heartbeat_timeout_s:
            self.set_failure(ErrorReport(rank, self.method, "silent",
                                         f"rank {rank} sent no heartbeat for {now - last[1]:.1f}s"))
            return
        pid = self._pids.get(rank)
        if pid is None:
            proc = self.control.process(rank)
            if proc is None:
                return  # not registered yet
            if proc[0] != self._host:
                self._pids[rank] = -1  # another host: the heartbeat is the only signal
                return
            pid = self._pids[rank] = proc[1]
        if pid > 0 and _pid_dead(pid):
            self.set_failure(ErrorReport(rank, self.method, "died", f"rank {rank} (pid {pid}) died"))
