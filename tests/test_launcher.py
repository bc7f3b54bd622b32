"""`hybridrl train`'s own process around torchrun's agent (`hybridrl/launcher.py`), with stand-ins for the
agent and its ranks (no torch): the agent starts with SIGINT / SIGTERM ignored, a signal to the launcher
reaches the ranks, the exit code says the job was interrupted, a second signal kills every process of
the job, and a job killed by a signal ends the launcher with that signal."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from tests.launch import ROOT, env_with_repo, kill_tree

RANK = textwrap.dedent("""
    import os, signal, sys, time
    out, obey = sys.argv[1], sys.argv[2] == "obey"
    open(out + ".start", "w").write(str(signal.getsignal(signal.SIGINT) == signal.SIG_IGN))
    def stop(signum, frame):
        open(out, "w").write(signal.Signals(signum).name)
        if obey:
            os._exit(0)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    while True:
        time.sleep(0.05)
""")
AGENT = textwrap.dedent("""
    import signal, subprocess, sys
    open(sys.argv[1] + ".agent", "w").write(str([signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)]))
    ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[3], f"{sys.argv[1]}.{r}", sys.argv[2]]) for r in range(2)]
    sys.exit(max(r.wait() for r in ranks))
""")
LAUNCH = "import sys; from hybridrl.launcher import supervise; sys.exit(supervise(sys.argv[1:]))"


def start(tmp_path: Path, behaviour: str) -> subprocess.Popen:
    out = str(tmp_path / "rank")
    job = subprocess.Popen([sys.executable, "-c", LAUNCH, sys.executable, "-c", AGENT, out, behaviour, RANK],
                           cwd=ROOT, env=env_with_repo(), start_new_session=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank.{r}.start").exists() for r in range(2)):
        assert time.monotonic() < deadline and job.poll() is None
        time.sleep(0.05)
    return job


def test_a_signal_to_the_launcher_reaches_the_ranks_and_the_exit_code_says_so(tmp_path):
    job = start(tmp_path, "obey")
    try:
        assert (tmp_path / "rank.agent").read_text() == "[True, True]"          # the agent ignores both
        assert (tmp_path / "rank.0.start").read_text() == "True"                # a rank installs its own
        job.send_signal(signal.SIGTERM)                 # `kill PID`: only the launcher gets it
        assert job.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        kill_tree(job.pid)
    assert [(tmp_path / f"rank.{r}").read_text() for r in range(2)] == ["SIGTERM", "SIGTERM"]


def test_a_second_signal_kills_every_process_of_the_job(tmp_path):
    job = start(tmp_path, "ignore")
    everyone = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    try:
        job.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while not (tmp_path / "rank.1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.poll() is None                        # the ranks heard it, and go on
        job.send_signal(signal.SIGINT)
        assert job.wait(timeout=30) == 128 + signal.SIGINT
    finally:
        kill_tree(job.pid)
    time.sleep(0.5)
    assert not [p for p in everyone[1:] if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_job_killed_by_a_signal_ends_the_launcher_the_same_way(tmp_path):
    job = start(tmp_path, "obey")
    agent = psutil.Process(job.pid).children()[0]
    ranks = agent.children()
    try:
        for p in (agent, *ranks):                        # what kill_job does: SIGKILL to the agent and the ranks
            p.kill()
        assert job.wait(timeout=30) == -signal.SIGKILL
    finally:
        kill_tree(job.pid)
        for p in ranks:
            if p.is_running():
                p.kill()
