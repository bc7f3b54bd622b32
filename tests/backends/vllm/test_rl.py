"""RL against vLLM with real ranks (torchrun, gloo, 2 CPU ranks, each with its own vLLM engine): a short
GRPO run, and the colocated corruption test (a copy damaged inside vLLM's worker is caught by the
read-back, copied again; damage on every copy stops the run naming the tensor)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.backends.vllm.conftest import MODEL_SPEC
from tests.launch import ROOT, env_with_repo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"
VLLM = ("rollout.engine=vllm", "rollout.vllm.kv_cache_mb=16")


def train(*overrides, timeout=1500):
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), *VLLM, *overrides]
    env = env_with_repo({"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})   # the fault is a function sent to the worker
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", **MODEL_SPEC)


def test_a_short_grpo_run_publishes_into_vllm_and_trains(tmp_path, model):
    proc = train(f"model.path={model}", f"run.dir={tmp_path}", "trainer.total_steps=2")
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows][-2:] == [1, 2]
    for r in rows[1:]:
        assert r["policy/lag_max"] == 0 and r["engine/decode_tokens"] > 0
        assert r["parity/max_abs"] < 1e-3            # vLLM's greedy logprobs vs the trainer's, after each publication
        assert r["publish/refused"] == 0
    assert rows[-1]["switch/publish_s"] > 0           # the mode switch published v1 and v2 into vLLM


def test_a_damaged_copy_inside_vllm_is_copied_again_and_a_persistent_one_stops_the_run(tmp_path, model):
    from tests.workers.hybrid_jobs import CORRUPTED

    proc = train(f"model.path={model}", f"run.dir={tmp_path}", "run.job=tests.backends.vllm.rl_jobs:CORRUPT",
                 "train.lr=1e-2", "train.lr_warmup_steps=0")
    result = tmp_path / "result.json"
    r = json.loads(result.read_text()) if result.exists() else None
    assert r is not None, proc.stderr[-6000:]
    assert proc.returncode != 0                        # the run stops at the publication that cannot be verified
    assert r["retried"]["published"] and r["retried"]["publish/retried_tensors"] == 1
    assert all(o["policy_version"] == 1 for rank in r["v1"] for o in rank)
    assert [o["logprobs"] for o in r["v1"][0]] != [o["logprobs"] for o in r["v0"][0]]
    assert CORRUPTED in r["failure"] and "twice" in r["failure"] and "enter_rollout" in r["failure"]
