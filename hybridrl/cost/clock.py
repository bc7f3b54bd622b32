"""The run's wall clock on the controller: when the job was launched, and the boundaries of what the
step metrics do not time (start-up, validations, checkpoints, the export, the time between steps).

    <run.dir>/clock.jsonl    one JSON object per mark: {"mark", "step", "at" (time.time()), "attempt"}

Marks, in the order an attempt writes them:

    start        the loop is ready: model loaded, worker group up, checkpoint restored. Carries
                 `launched_at` (when the command started: `hybridrl train` passes its own process
                 start to the job in HYBRIDRL_LAUNCHED_AT; else torchrun's process start) and
                 `rank_started_at` (this rank's process start), so start-up is [launched_at,
                 rank_started_at, start].
    step         the top of an RL step (its metrics row times what follows: stages, step_s,
                 validation, store, and `time/logged_at` when the row was ready)
    checkpoint   a checkpoint began; `checkpoint_end` when it was complete
    finish       the loop is over: export and shutdown follow
    end          the loop's last mark (the summary is printed)
    exit         the process exits normally (an atexit hook: after the worker group's shutdown)
    released     the launcher (torchrun) exited after a normal exit: the devices are free. Written by
                 a small watcher process the start mark spawns (stdlib only, no inherited output):
                 the ranks' interpreter teardown and torchrun's own exit take seconds that no rank
                 can time. The watcher ends with the launcher (at most `WATCH_LIMIT_S` after the
                 exit mark); an attempt that did not exit normally gets no `released` mark.

A fresh run rewrites the file; a resumed run appends a new attempt (the killed attempt's marks stay:
the time it spent is part of what the run cost). `hybridrl.cost.accounting` reads the marks back.
Writing a mark costs one small append: it never changes what the run computes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

CLOCK_FILE = "clock.jsonl"
_LAUNCHERS = ("torch.distributed.run", "torchrun", "torch/distributed/run")   # "torchrun": hybridrl.torchrun too


def process_start(pid: int | None = None) -> float | None:
    """When a process started (time.time() scale), to the kernel's clock tick.

    psutil's `create_time` adds the process's start (ticks since boot) to the boot time, which Linux
    states in whole seconds (/proc/stat btime): up to a second early, by the same amount for every
    process of a boot. Here both ends come from one clock: now, less the time since boot now, plus
    the start's time since boot. Elsewhere psutil's value; None when the process is gone."""
    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()       # from field 3 (state) on: starttime is field 22
        started_since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:          # psutil missing or the process gone: start-up is then not split
        return None


def launched_at() -> float | None:
    """When the job was launched: the `hybridrl train` command's process start (it runs torchrun's agent
    as its child and says when it started in HYBRIDRL_LAUNCHED_AT); else torchrun's process start when
    this rank runs under it; else this process's own start."""
    if os.environ.get("HYBRIDRL_LAUNCHED_AT"):
        try:
            return float(os.environ["HYBRIDRL_LAUNCHED_AT"])
        except ValueError:
            pass
    try:
        import psutil

        parent = psutil.Process().parent()
        if parent is not None and any(k in " ".join(parent.cmdline()) for k in _LAUNCHERS):
            return process_start(parent.pid)
    except Exception:
        pass
    return process_start()


class RunClock:
    """Appends marks to `<run.dir>/clock.jsonl` (rank 0 only: the controller's clock)."""

    def __init__(self, run_dir: str | Path, attempt: int):
        self.path = Path(run_dir) / CLOCK_FILE
        self.attempt = attempt

    @classmethod
    def start(cls, cfg: Any, *, resumed: bool, step: int, world_size: int) -> "RunClock":
        path = Path(cfg.run.dir) / CLOCK_FILE
        earlier = read_clock(cfg.run.dir) if resumed else []
        if not resumed and path.exists():
            path.unlink()           # a fresh run: an old clock (an overwritten run's) is not this run's
        clock = cls(cfg.run.dir, attempt=1 + max((m.get("attempt", 0) for m in earlier), default=0))
        clock.mark("start", step, launched_at=launched_at(), rank_started_at=process_start(),
                   world_size=world_size, pid=os.getpid(), resumed=resumed)
        atexit.register(clock.mark, "exit")      # after the worker group and process groups are shut down
        clock.watch_release()
        return clock

    def mark(self, mark: str, step: int | None = None, **extra: Any) -> None:
        row = {"mark": mark, "step": step, "at": time.time(), "attempt": self.attempt, **extra}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def watch_release(self) -> None:
        """Start the watcher that writes `released` when the launcher exits after this attempt's exit."""
        import subprocess
        import sys

        try:
            import psutil

            parent = psutil.Process().parent()
            launcher = parent.pid if parent is not None and any(
                k in " ".join(parent.cmdline()) for k in _LAUNCHERS) else None
        except Exception:
            launcher = None
        if launcher is None:
            return
        env = {"HYBRIDRL_CLOCK": str(self.path), "HYBRIDRL_CLOCK_ATTEMPT": str(self.attempt),
               "HYBRIDRL_CLOCK_RANK_PID": str(os.getpid()), "HYBRIDRL_CLOCK_LAUNCHER_PID": str(launcher),
               "HYBRIDRL_CLOCK_LIMIT_S": str(WATCH_LIMIT_S)}
        try:
            subprocess.Popen([sys.executable, "-S", "-c", _WATCHER], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                             start_new_session=True)
        except OSError:
            pass                    # no watcher: the books end at the exit mark

    @contextlib.contextmanager
    def span(self, mark: str, step: int | None = None) -> Iterator[None]:
        """`mark` before the block, `<mark>_end` after it (not written when the block raises)."""
        self.mark(mark, step)
        yield
        self.mark(f"{mark}_end", step)


WATCH_LIMIT_S = 60.0

# The watcher (a separate interpreter, stdlib only): wait for this rank to end; if its attempt's last
# mark is `exit`, wait for the launcher to end too and append `released` with the time.
_WATCHER = r"""
import json, os, time
env = os.environ
path, attempt = env["HYBRIDRL_CLOCK"], int(env["HYBRIDRL_CLOCK_ATTEMPT"])
rank, launcher = int(env["HYBRIDRL_CLOCK_RANK_PID"]), int(env["HYBRIDRL_CLOCK_LAUNCHER_PID"])
limit = float(env["HYBRIDRL_CLOCK_LIMIT_S"])

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False

while alive(rank):
    time.sleep(0.05)
try:
    marks = [json.loads(l) for l in open(path) if l.strip()]
except OSError:
    marks = []
mine = [m for m in marks if m.get("attempt") == attempt]
if mine and mine[-1].get("mark") == "exit":
    deadline = time.time() + limit
    while alive(launcher) and time.time() < deadline:
        time.sleep(0.02)
    if not alive(launcher):
        with open(path, "a") as f:
            f.write(json.dumps({"mark": "released", "step": None, "at": time.time(), "attempt": attempt}) + "\n")
"""


def read_clock(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / CLOCK_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
