"""A rank's process leaves without the interpreter's teardown.

After a rank's last line, Python tears the interpreter down: every module's globals, torch's
operator registrations (`torch.library` finalizers), megatron-core's classes. With torch and
megatron-core imported that is ~1.1 s of CPU per process on a 2-core machine (0.76 s for torch
alone), paid by every rank of every run and every test launch, and it frees nothing the kernel does
not free at exit anyway.

`run_then_leave(main)` runs `main` and exits with its status as usual: uncaught errors print their
traceback, non-daemon threads are joined, every `atexit` handler runs (logging's flush and close,
the run clock's `exit` mark, the interrupt listener's detach, temporary directories' finalizers).
Its own handler is registered before any other, so it runs after all of them; it flushes stdout
and stderr and ends the process with `os._exit(status)`, skipping only the teardown.

`torchrun_command` is the one command line hybridrl's commands start their ranks with: torchrun's
agent as `python -m hybridrl.torchrun`, which leaves the same way.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import Any, Callable


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """torchrun's agent for `nproc` ranks on this host (`--standalone`), then `args` (its own options, then
    `-m MODULE ...`)."""
    return [sys.executable, "-m", "hybridrl.torchrun", "--standalone", f"--nproc-per-node={nproc}", *args]


def exit_status(code: Any) -> int:
    """The status `sys.exit(code)` gives: None 0, an int itself, anything else 1 (Python prints it)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def run_then_leave(main: Callable[[], Any]) -> None:
    status = [1]                   # until main says otherwise: an error escaping main is a failure

    def leave() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):     # closed or gone: nothing left to flush
                pass
        os._exit(status[0])

    atexit.register(leave)          # first registered, so the last to run (handlers run in reverse)
    try:
        code = main()
    except SystemExit as stop:
        status[0] = exit_status(stop.code)
        raise
    except KeyboardInterrupt:
        status[0] = 128 + signal.SIGINT
        raise
    status[0] = exit_status(code)
    sys.exit(status[0])
