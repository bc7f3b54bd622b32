"""Fixtures for the Megatron backend tests: tiny models with non-flat logits, and a launcher for
the multi-rank jobs in `jobs.py` (real ranks under torchrun, gloo)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.launch import run_torchrun

# Weights scaled up from the 0.02 default so that a layout mistake moves the logits visibly.
INIT_STD = 0.1


@pytest.fixture(scope="session")
def qwen2_dir(tiny_models) -> Path:
    return tiny_models("qwen2", init_std=INIT_STD)


@pytest.fixture(scope="session")
def llama_dir(tiny_models) -> Path:
    return tiny_models("llama", init_std=INIT_STD)


def run_job(nproc: int, job: str, out: Path, *args, timeout: float = 300,
            expect_ok: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc -m tests.backends.megatron.jobs JOB OUT ARGS...`."""
    proc = run_torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "tests.backends.megatron.jobs", job,
                         str(out), *map(str, args)], timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    if expect_ok:
        assert proc.returncode == 0, f"job {job} failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    return proc
