"""Processes a rank starts through a library that must not outlive the rank, however it ends.

A library that runs processes of its own (vLLM's engine core and its worker) ends them when it is
shut down; a rank killed by SIGKILL (an out-of-memory kill, a scheduler's, `kill -9` of the job)
shuts nothing down, and those processes are re-parented and run on, holding memory and the run's
files. `Reaper(pids)` starts one small watcher process holding the read end of a pipe whose write
end only this process holds. When this process ends, in whatever way, the kernel closes the write
end; the watcher's read returns and it SIGKILLs the processes it was given, each checked by its
start time first (a pid the system has since given to another process is left alone), and exits.
`Reaper.close()` does the same at once, after a library's own shutdown has had its chance.

The watcher runs in a session of its own, so the signal that stops the job (Ctrl-C to its process
group) does not stop the watcher before the processes it watches are gone. Linux only (/proc).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterable


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None where unknown,
    "dead" for a process that exited and is not yet reaped; with the pid it names one process (pids
    are reused, start times with them are not)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in ("Z", "X"):
        return "dead"
    return fields[19]


def descendants(pid: int | None = None) -> list[int]:
    """Every process below `pid` (default: this one), children first."""
    out, frontier = [], [pid or os.getpid()]
    while frontier:
        parent = frontier.pop(0)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                if child not in out:
                    out.append(child)
                    frontier.append(child)
    return out


class Reaper:
    def __init__(self, pids: Iterable[int]):
        targets = [f"{pid}:{started}" for pid in pids if (started := start_time(pid)) not in (None, "dead")]
        self.pids = [int(t.split(":")[0]) for t in targets]
        read, self._write = os.pipe()                    # both ends close on exec: only the watcher gets `read`
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                                        os.environ.get("PYTHONPATH")) if p)}
        try:
            self._watcher = subprocess.Popen([sys.executable, "-m", __name__, str(read), *targets], pass_fds=(read,),
                                             start_new_session=True, stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(read)

    def close(self, timeout: float = 10.0) -> None:
        """Kill what is left of the watched processes now and wait for the watcher (idempotent)."""
        if self._write is not None:
            os.close(self._write)
            self._write = None
            try:
                self._watcher.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._watcher.kill()
                self._watcher.wait()


def _watch(argv: list[str]) -> None:
    """The watcher: wait for the pipe's end of file, then kill the targets still alive as they were."""
    fd, targets = int(argv[0]), [arg.split(":", 1) for arg in argv[1:]]
    while os.read(fd, 1):
        pass
    for pid, started in targets:
        if start_time(int(pid)) == started:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    _watch(sys.argv[1:])
