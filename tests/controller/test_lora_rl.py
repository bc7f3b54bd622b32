"""A LoRA actor through the RL loop with real ranks: every mode switch publishes the adapters alone into
the native engines, which apply them at run time (the trainer scores what they sampled), and kill -9 +
resume=auto reproduces the uninterrupted run bitwise: every logged number and the exported (merged) weights
(the adapters and their optimizer state are the checkpoint's; the frozen base is read from its directory).
The run's end writes the adapters as a PEFT directory (hf_peft/) and `hybridrl export --peft` writes a
checkpoint's: both load in peft and give the merged model's logits."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train, kill_9_then_resume

# a random tiny model earns no reward (every advantage is 0): the entropy bonus moves the adapters all the same
LORA = ("train.lora.rank=4", "train.lora.alpha=8", "train.lr=1e-3", "algo.entropy_coef=0.01")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_models):
    """(model, the common overrides, an uninterrupted 4-step LoRA run with checkpoints at 2 and 4)."""
    model = tiny_models("qwen2", init_std=0.05)
    common = [f"model.path={model}", *STRAIGHT, *LORA]
    straight = tmp_path_factory.mktemp("lora") / "straight"
    proc = hybridrl_train(RECIPE, *common, f"run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return model, common, straight


@pytest.mark.slow
def test_lora_run_publishes_adapters_only_and_resumes_exactly(tmp_path, lora_run):
    model, common, straight = lora_run
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


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


@pytest.mark.slow
def test_lora_adapters_export_as_peft_and_equal_the_merged_model(tmp_path, lora_run):
    """hf_peft/ (the run's end) and `hybridrl export --peft` of the last checkpoint load with
    PeftModel.from_pretrained on the base and give the logits of the merged hf/, which differ from the base's;
    the export starts two ranks and prints no torchrun banner or deprecation warning."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.launch import ROOT, env_with_repo

    model, _, straight = lora_run
    out = tmp_path / "adapter"
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "export", str(straight), "--peft", "--out", str(out),
                           "--nproc-per-node", "2"], cwd=ROOT, env=env_with_repo(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"exported the LoRA adapters of step 4 of {straight}" in proc.stdout
    assert "Warning" not in proc.stderr and "OMP_NUM_THREADS" not in proc.stderr, proc.stderr
    ids = torch.tensor([[3, 17, 42, 8, 99, 5, 23, 61], [7, 7, 1, 2, 30, 44, 12, 9]])
    merged = _logits(AutoModelForCausalLM.from_pretrained(straight / "hf", dtype=torch.float32).eval(), ids)
    base = _logits(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval(), ids)
    assert (merged - base).abs().max() > 1e-3                 # the adapters moved the policy
    for adapter in (straight / "hf_peft", out):
        fresh = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        with_peft = _logits(PeftModel.from_pretrained(fresh, adapter).eval(), ids)
        assert (with_peft - merged).abs().max() < 1e-4, adapter
