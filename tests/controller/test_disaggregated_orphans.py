"""A disaggregated job SIGKILLed (its whole process group, as `kill -9 -PGID` does) at moments around
its step-2 checkpoint leaves no process of its own behind: none carrying the run directory on its
command line, none holding a file under it open. The run keeps sandboxes warm on the rollout rank
(its task may call the `python` tool), whose producer runs on a thread of its own; the training rank
writes the checkpoint (megatron-core's writer forks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.controller.test_disaggregated import DISAGGREGATED
from tests.controller.test_rl_e2e import RECIPE
from tests.launch import ROOT, env_with_repo, kill_tree

MOMENTS = {"inside_the_save": ("model", 0.0), "at_complete": ("COMPLETE", 0.0), "after_complete": ("COMPLETE", 0.4)}


def processes_of_run(run_dir: Path) -> list[psutil.Process]:
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


def sandboxes_of(job: subprocess.Popen) -> list[psutil.Process]:
    """The job's processes in sessions of their own (the tool sandboxes): a process-group kill misses them."""
    try:
        return [p for p in psutil.Process(job.pid).children(recursive=True) if os.getsid(p.pid) != os.getsid(job.pid)]
    except (psutil.Error, ProcessLookupError):
        return []


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_a_disaggregated_job_killed_around_a_checkpoint_leaves_no_process(tmp_path, tiny_models, moment):
    model = tiny_models("qwen2", init_std=0.05)
    run_dir = tmp_path / "run"
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(
        [sys.executable, "-m", "hybridrl", "train", str(RECIPE), *DISAGGREGATED, "algo.max_policy_lag=1",
         "task.name=tests.controller.coin_task:PythonCoinTask", "tools.warm=2", f"model.path={model}",
         f"run.dir={run_dir}", "trainer.total_steps=50", "trainer.checkpoint_every=2"],
        cwd=ROOT, env=env_with_repo(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    what, delay = MOMENTS[moment]
    target = run_dir / "checkpoints" / "step_000002" / what
    described, sandboxes = [], []
    try:
        deadline = time.monotonic() + 600
        while not target.exists():
            assert job.poll() is None, f"the run ended (exit {job.returncode}): {(tmp_path / 'job.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{target} did not appear"
            sandboxes = sandboxes_of(job) or sandboxes
            time.sleep(0.005)
        time.sleep(delay)
        sandboxes = sandboxes_of(job) or sandboxes
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        deadline = time.monotonic() + 60          # what outlives the group must notice and end by itself
        while (left := processes_of_run(run_dir) + [p for p in sandboxes if p.is_running()]) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in left:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
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
    assert sandboxes, "the run kept no sandbox warm: nothing of the rollout rank's tools was checked"
    assert not described, "processes outlived the killed job:\n" + "\n".join(described)
