"""A LoRA actor through the RL loop with real ranks: every mode switch publishes the adapters alone into
the native engines, which apply them at run time (the trainer scores what they sampled), and kill -9 +
resume=auto reproduces the uninterrupted run bitwise: every logged number and the exported (merged) weights
(the adapters and their optimizer state are the checkpoint's; the frozen base is read from its directory)."""

from __future__ import annotations

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train, kill_9_then_resume

LORA = ("train.lora.rank=4", "train.lora.alpha=8", "train.lr=1e-3")


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
    for r in rows[1:]:
        assert 0 < r["publish/bytes"] < 0.2 * whole, r           # the adapters' A and B, never the model
        assert r["mismatch/max_abs"] < 1e-4 and r["parity/max_abs"] < 1e-4, r
    trained = load_file(str(straight / "hf" / "model.safetensors"))
    assert max(float((trained[k] - weights[k]).abs().max()) for k in weights) > 0    # the adapters moved
    kill_9_then_resume(straight, tmp_path / "killed", common)
