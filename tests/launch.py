"""Launch real ranks for tests: through torchrun, or bare (no elastic agent) to test our own
failure handling without torchrun's agent killing the group first."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_repo(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str


@dataclass
class Launch:
    results: list[RankResult]
    seconds: float

    @property
    def codes(self) -> list[int | None]:
        return [r.returncode for r in self.results]

    def stderr(self, rank: int = 0) -> str:
        return self.results[rank].stderr

    @property
    def all_stderr(self) -> str:
        return "\n".join(f"--- rank {r.rank} ---\n{r.stderr}" for r in self.results)


def launch_bare(world_size: int, config: str | Path, overrides: list[str], *, timeout: float = 120,
                during=None) -> Launch:
    """Start `python -m hybridrl.train` once per rank with the torchrun environment, no agent.

    `during(procs)` runs while they are alive (e.g. to kill one)."""
    port = free_port()
    procs = []
    started = time.perf_counter()
    for rank in range(world_size):
        env = env_with_repo({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                             "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hybridrl.train", "--config", str(config), *overrides],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True))
    if during is not None:
        during(procs)
    results = []
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            out, err = p.communicate()
            err += f"\n[launch_bare: rank {rank} killed after the {timeout}s test timeout]"
            results.append(RankResult(rank, None, out, err))
            continue
        results.append(RankResult(rank, p.returncode, out, err))
    return Launch(results, time.perf_counter() - started)


def run_torchrun(args: list[str], *, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridrl.torchrun", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env_with_repo(env), capture_output=True, text=True, timeout=timeout)


def kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for child in parent.children(recursive=True) + [parent]:
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def processes_mentioning(marker: str) -> list[psutil.Process]:
    """Live processes whose command line contains `marker` (to prove nothing was left behind)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
