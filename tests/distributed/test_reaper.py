"""A rank's library processes die with it, however it ends (hybridrl/distributed/reaper.py): real
processes, a real SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybridrl.distributed.reaper import Reaper, descendants, start_time

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")

# a stand-in for a rank that builds an engine with processes of its own: one child in the rank's
# process group and one that left it (as a daemonised server would), both guarded, then the rank waits
RANK = textwrap.dedent("""
    import json, subprocess, sys, time
    from hybridrl.distributed.reaper import Reaper, descendants
    inside = subprocess.Popen(["sleep", "300"])
    outside = subprocess.Popen(["sleep", "300"], start_new_session=True)
    reaper = Reaper(descendants())
    print(json.dumps({"guarded": reaper.pids, "watcher": reaper._watcher.pid}), flush=True)
    time.sleep(300)
""")


def gone(pids: list[int], within: float = 15.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [p for p in pids if start_time(p) is not None and _state(p) != "Z"]
        if not alive:
            return []
        time.sleep(0.05)
    return alive


def _state(pid: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_rank_killed_by_sigkill_leaves_none_of_its_processes():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        seen = json.loads(rank.stdout.readline())
        assert len(seen["guarded"]) == 2 and all(start_time(p) for p in seen["guarded"])
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
        assert gone(seen["guarded"]) == [], "a guarded process outlived its rank"
        assert gone([seen["watcher"]]) == [], "the watcher outlived its work"
    finally:
        rank.kill()
        for pid in descendants(rank.pid):
            os.kill(pid, signal.SIGKILL)


def test_close_ends_the_processes_left_and_a_reused_pid_is_left_alone():
    child = subprocess.Popen(["sleep", "300"])
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        reaper = Reaper([child.pid])
        # the bystander stands for a pid the system gave to another process: its start time differs
        watcher = subprocess.Popen([sys.executable, "-m", "hybridrl.distributed.reaper", "0",
                                    f"{bystander.pid}:{int(start_time(bystander.pid)) + 1}"], stdin=subprocess.DEVNULL)
        assert watcher.wait(timeout=30) == 0
        reaper.close()
        assert child.wait(timeout=10) == -signal.SIGKILL
        assert bystander.poll() is None
        reaper.close()                                       # idempotent
    finally:
        child.kill()
        bystander.kill()
