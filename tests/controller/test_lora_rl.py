"""A LoRA actor through the RL loop with real ranks: every mode switch publishes the adapters alone into
the native engines, which apply them at run time (the trainer scores what they sampled), and kill -9 +
resume=auto reproduces the uninterrupted run bitwise: every logged number and the exported (merged) weights
(the adapters and their optimizer state are the checkpoint's; the frozen base is read from its directory)."""

from __future__ import annotations

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train, kill_9_then_resume

# a random tiny model earns no reward (every advantage is 0): the entropy bonus moves the adapters all the same
LORA = ("train.lora.rank=4", "train.lora.alpha=8", "train.lr=1e-3", "algo.entropy_coef=0.01")


@pytest.mark.slow
def test_lora_run_publishes_adapters_only_and_resumes_exactly(tmp_path, tiny_models):
    model = tiny_models("qwen2", init_std=0.05)
    common = [f"model.path={model}", *STRAIGHT, *LORA]
    straight = tmp_path / "straight"
    proc = hybridrl_train(RECIPE, *common, f"run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    from safetensors.torch import load_file

    weights = load_file(str(model / "model.safetensors"))
    whole = sum(t.numel() * t.element_size() for t in weights.values())
    rows = read_metrics(straight)
    published = [r for r in rows if "publish/bytes" in r]       # step 1 serves v0, what the engines loaded
    assert [r["step"] for r in published] == [2, 3, 4]
    for r in published:
        assert 0 < r["publish/bytes"] < 0.2 * whole, r           # the adapters' A and B, never the model
        assert r["parity/max_abs"] < 1e-4, r
    assert all(r["mismatch/max_abs"] < 1e-4 for r in rows[1:])  # the trainer scores what the engines sampled
    trained = load_file(str(straight / "hf" / "model.safetensors"))
    assert max(float((trained[k] - weights[k]).abs().max()) for k in weights) > 0    # the adapters moved
    kill_9_then_resume(straight, tmp_path / "killed", common)


@pytest.mark.slow
def test_a_disaggregated_lora_run_sends_the_adapters_only(tmp_path, tiny_models):
    """The rollout rank's native engine applies the adapters; training rank 0 broadcasts them alone."""
    model = tiny_models("qwen2", init_std=0.05)
    proc = hybridrl_train(RECIPE, f"model.path={model}", f"run.dir={tmp_path}", "trainer.total_steps=2", *LORA,
                          "placement.mode=disaggregated", "placement.rollout_ranks=1", "algo.max_policy_lag=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    from safetensors.torch import load_file

    whole = sum(t.numel() * t.element_size() for t in load_file(str(model / "model.safetensors")).values())
    published = [r for r in read_metrics(tmp_path) if "publish/bytes" in r]
    assert published
    for r in published:
        assert 0 < r["publish/bytes"] < 0.2 * whole and r["publish/refused"] == 0, r
        assert r["parity/max_abs"] < 1e-4, r
