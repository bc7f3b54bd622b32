"""Run pytest while the machine is busy: LOAD_PER_CORE busy-loop processes per core beside it.

    python tests/run_loaded.py [pytest arguments]       (make test-loaded PYTEST_ARGS=...)

A test that passes only on an idle machine hides a timing assumption (in the test or in the code it
tests); this is how to find them. The busy loops run at the same priority as pytest and are always
killed at exit (normal end, error, Ctrl-C, SIGTERM); they also die on their own if this process dies
(PR_SET_PDEATHSIG), so none is ever left behind. Exit status: pytest's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

LOAD_PER_CORE = int(os.environ.get("HYBRIDRL_LOAD_PER_CORE", "2"))

# each loop asks the kernel to SIGKILL it when its parent (this script) dies, then spins
BUSY = ("import ctypes, os, signal, sys\n"
        "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
        "if os.getppid() != int(sys.argv[1]):\n    sys.exit(0)\n"
        "while True:\n    pass\n")


def main(argv: list[str]) -> int:
    cores = len(os.sched_getaffinity(0))
    loops: list[subprocess.Popen] = []

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        for _ in range(LOAD_PER_CORE * cores):
            loops.append(subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())]))
        print(f"run_loaded: {len(loops)} busy loops on {cores} cores beside pytest", flush=True)
        started = time.monotonic()
        rc = subprocess.call([sys.executable, "-m", "pytest", *argv])
        print(f"run_loaded: pytest exit {rc} after {time.monotonic() - started:.0f} s under load "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        return rc
    except KeyboardInterrupt:
        return 130
    finally:
        for p in loops:
            p.kill()
        for p in loops:
            p.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
