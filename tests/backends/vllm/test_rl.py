"""RL against vLLM with real ranks (torchrun, gloo, 2 CPU ranks, each with its own vLLM engine): a short
GRPO run, and the colocated corruption test (a copy damaged inside vLLM's worker is caught by the
read-back, copied again; damage on every copy stops the run naming the tensor)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.backends.vllm.conftest import MODEL_SPEC
from tests.launch import ROOT, env_with_repo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"
VLLM = ("rollout.engine=vllm", "rollout.vllm.kv_cache_mb=16")


def train(tmp_path, *overrides, timeout=1500):
    """The run in a session of its own, its output in files, and its process group killed once the launcher
    has exited: a belt to the engine's braces (a rank killed after a worker error has its vLLM processes
    ended by the engine's reaper; tests/backends/vllm/test_processes.py)."""
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), *VLLM, *overrides]
    env = env_with_repo({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})   # the fault is a function sent to the worker
    out, err = tmp_path.with_suffix(".out"), tmp_path.with_suffix(".err")     # beside the run directory
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=e, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out.read_text(), err.read_text())


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", **MODEL_SPEC)


def test_a_short_grpo_run_publishes_into_vllm_and_trains(tmp_path, model):
    proc = train(tmp_path, f"model.path={model}", f"run.dir={tmp_path}", "trainer.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["policy/lag_max"] == 0 and r["engine/decode_tokens"] > 0
    first, second = rows
    assert "switch/publish_s" not in first             # step 1 samples v0, the weights vLLM loaded from disk
    assert second["policy/version"] == 2 and second["publish/refused"] == 0
    assert second["switch/publish_s"] > 0               # the mode switch published v1 into vLLM, verified
    assert second["parity/tokens"] == 16 and second["parity/max_abs"] < 1e-4   # vLLM vs the trainer, after it


def test_a_damaged_copy_inside_vllm_is_copied_again_and_a_persistent_one_stops_the_run(tmp_path, model):
    from tests.workers.hybrid_jobs import CORRUPTED

    proc = train(tmp_path, f"model.path={model}", f"run.dir={tmp_path}", "run.job=tests.backends.vllm.rl_jobs:CORRUPT",
                 "train.lr=1e-2", "train.lr_warmup_steps=0")
    result = tmp_path / "result.json"
    r = json.loads(result.read_text()) if result.exists() else None
    assert r is not None, proc.stderr[-6000:]
    assert proc.returncode != 0                        # the run stops at the publication that cannot be verified
    assert r["retried"]["published"] and r["retried"]["publish/retried_tensors"] == 1
    assert all(o["policy_version"] == 1 for rank in r["v1"] for o in rank)
    assert [o["logprobs"] for o in r["v1"][0]] != [o["logprobs"] for o in r["v0"][0]]
    assert CORRUPTED in r["failure"] and "twice" in r["failure"] and "enter_rollout" in r["failure"]
