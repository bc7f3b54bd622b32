"""A job SIGKILLed around a checkpoint save leaves no process of its own behind.

`hybridrl train` is started the way a shell starts a job (its own process group), and the whole
group gets SIGKILL at a moment around the step-2 checkpoint: inside the save (as soon as a rank has
forked the checkpoint writer's processes), as its COMPLETE marker appears, and shortly after. Then no live process may carry the run directory on its
command line or hold a file under it open. (megatron-core's checkpoint writer used to start a
Manager server process per save; killed mid-save, it and the ranks waiting on it stayed alive,
hundreds of MB each, with the run's files open.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.launch import ROOT, env_with_repo, kill_tree

RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"
MOMENTS = {"inside_the_save": ("fork", 0.0), "at_complete": ("complete", 0.0), "after_complete": ("complete", 0.4)}


def processes_of_run(run_dir: Path) -> list[psutil.Process]:
    """Live processes naming `run_dir` on their command line or holding a file under it open."""
    marker, found = str(run_dir), []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if marker in " ".join(p.info["cmdline"] or []) or any(f.path.startswith(marker) for f in p.open_files()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _forked_by_a_rank(job: subprocess.Popen) -> bool:
    """A rank (a child of the torchrun agent) has a child of its own: the checkpoint writer's."""
    try:
        return any(rank.children() for rank in psutil.Process(job.pid).children())
    except psutil.NoSuchProcess:
        return False


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float, *, until_fork: bool = False) -> None:
    """Until `path` exists (and, with `until_fork`, a rank has forked or the save completed)."""
    deadline = time.monotonic() + timeout
    while not path.exists() or (until_fork and not _forked_by_a_rank(proc) and not (path / "COMPLETE").exists()):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {path} appeared")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.005)


@pytest.mark.parametrize("moment", [
    "inside_the_save",
    pytest.param("at_complete", marks=pytest.mark.slow),
    pytest.param("after_complete", marks=pytest.mark.slow),
])
def test_a_job_killed_around_a_checkpoint_leaves_no_process(tmp_path, tiny_models, moment):
    model = tiny_models("qwen2", init_std=0.05)
    run_dir = tmp_path / "run"
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(
        [sys.executable, "-m", "hybridrl", "train", str(RECIPE), f"model.path={model}", f"run.dir={run_dir}",
         "trainer.total_steps=50", "trainer.checkpoint_every=1"],
        cwd=ROOT, env=env_with_repo(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    what, delay = MOMENTS[moment]
    checkpoint = run_dir / "checkpoints" / "step_000002"
    described: list[str] = []
    try:
        _wait_for(checkpoint / "COMPLETE" if what == "complete" else checkpoint, job, timeout=400,
                  until_fork=what == "fork")
        time.sleep(delay)
        os.killpg(job.pid, signal.SIGKILL)       # what `kill -9 -PGID` of the job does
        job.wait(timeout=30)
        deadline = time.monotonic() + 60         # the ranks notice their agent is gone and exit
        while (left := processes_of_run(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in left:
            try:
                described.append(f"pid {p.pid} ppid {p.ppid()} {p.memory_info().rss >> 20} MB: "
                                 f"{' '.join(p.cmdline())[:160]}")
            except psutil.NoSuchProcess:
                continue
    finally:
        for p in processes_of_run(run_dir):
            kill_tree(p.pid)
        if job.poll() is None:
            kill_tree(job.pid)
        log.close()
    assert not described, "processes outlived the killed job:\n" + "\n".join(described)
