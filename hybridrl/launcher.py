"""What `hybridrl train` does while its job runs: torchrun's agent is its child, and it stands by for
the user's signals.

    hybridrl train  --child-->  torchrun agent  --children-->  ranks

The agent starts with SIGINT and SIGTERM ignored (inherited, and its `--signals-to-handle`, set
through `PET_SIGNALS_TO_HANDLE`, leaves them out), so it neither stops the ranks itself nor prints
its failure report for them, and never restarts them for a Ctrl-C. The first SIGINT / SIGTERM this process gets is forwarded to the
ranks (rank 0 stops the run: `hybridrl/controller/interrupts.py`), again every second until they are gone (a
rank still starting may not listen yet). A second signal, or ranks still running `KILL_AFTER_S`
after the first, kill the job: SIGKILL to the agent and every process under it.

Exit code: the job's; 128 + the signal (130 SIGINT, 143 SIGTERM) when it was interrupted; a job
killed by a signal ends this process with that signal. The job stays in this process's process
group, so `kill -9 -PGID` (or the terminal) reaches all of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from hybridrl.cost.clock import process_start

SIGNALS = (signal.SIGINT, signal.SIGTERM)
KILL_AFTER_S = 60.0
_FORWARD_EVERY_S = 1.0


def _ignore_signals() -> None:            # in the agent's process, before its exec
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def supervise(cmd: Sequence[str], run_dir: str | None = None) -> int:
    """Run torchrun's agent (`cmd`) to its end; see the module doc."""
    import psutil

    received: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in SIGNALS}
    started = time.time()
    env = dict(os.environ, PET_SIGNALS_TO_HANDLE="SIGHUP,SIGQUIT")     # torchrun's --signals-to-handle
    # the run's clock starts when the command did, not when its agent did (hybridrl/cost/clock.py)
    env["HYBRIDRL_LAUNCHED_AT"] = repr(process_start())
    try:
        job = subprocess.Popen(list(cmd), env=env, preexec_fn=_ignore_signals)
        first_at, forwarded_at, killed = None, 0.0, False
        while True:
            try:
                code = job.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if not received or killed:
                continue
            now = time.monotonic()
            first_at = first_at or now
            if len(received) > 1 or now - first_at > KILL_AFTER_S:
                why = f"a second {signal.Signals(received[-1]).name}" if len(received) > 1 else \
                    f"the ranks still running {KILL_AFTER_S:.0f}s after {signal.Signals(received[0]).name}"
                print(f"hybridrl: {why}: killing the job (the same command resumes from its newest checkpoint)",
                      file=sys.stderr, flush=True)
                _kill_tree(psutil, job.pid)
                killed = True
            elif now - forwarded_at >= _FORWARD_EVERY_S:
                _forward(psutil, job.pid, received[0])
                forwarded_at = now
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    interrupted = _interrupted_by(run_dir, started)     # also when a rank was sent the signal directly
    if killed or interrupted or (received and code <= 0):
        return 128 + (interrupted or received[0])
    if code < 0:                       # killed by a signal nobody sent us (e.g. a fault injection's SIGKILL)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _forward(psutil, pid: int, signum: int) -> None:
    try:
        ranks = psutil.Process(pid).children()
    except psutil.Error:
        return
    for rank in ranks:
        try:
            rank.send_signal(signum)
        except psutil.Error:
            continue


def _kill_tree(psutil, pid: int) -> None:
    try:
        agent = psutil.Process(pid)
        everyone = [agent, *agent.children(recursive=True)]
    except psutil.Error:
        return
    for p in everyone:
        try:
            p.kill()
        except psutil.Error:
            continue


def _interrupted_by(run_dir: str | None, since: float) -> int | None:
    """The signal's number when run.json says this launch's run was interrupted."""
    if not run_dir:
        return None
    from hybridrl.store.rundir import read_record

    record = read_record(Path(run_dir))
    if record.get("status") != "interrupted" or record.get("interrupted_at_s", 0) < since:
        return None
    return int(getattr(signal, record.get("signal", "SIGINT")))
