"""The same jobs on CUDA (NCCL): fp32 parity at the CPU bounds, bf16 parity at bf16 bounds, training
against transformers, and offload really releasing device memory. Skipped without GPUs."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.backends.megatron.conftest import run_job


def _env(dtype="float32"):
    return {"HYBRIDRL_TEST_DEVICE": "cuda", "HYBRIDRL_TEST_DTYPE": dtype}


@pytest.fixture
def cuda_env(monkeypatch):
    def use(dtype="float32"):
        for k, v in _env(dtype).items():
            monkeypatch.setenv(k, v)
    return use


@pytest.mark.gpu(1)
@pytest.mark.parametrize("dtype,bound", [("float32", 1e-4), ("bfloat16", 0.1)])
def test_gpu_logits_parity(tmp_path, qwen2_dir, llama_dir, cuda_env, dtype, bound):
    cuda_env(dtype)
    run_job(1, "parity", tmp_path, qwen2_dir, llama_dir)
    result = json.loads((tmp_path / "parity.json").read_text())
    for family in ("qwen2", "llama"):
        (rec,) = result[family]["tp1"]
        assert rec["logits_max_abs_diff"] < bound * max(1.0, rec["logits_max_abs"]), rec
        assert rec["logprobs_max_abs_diff"] < bound * 2, rec
        if dtype == "float32":
            assert rec["bitwise_equal"], rec


@pytest.mark.gpu(2)
def test_gpu_parity_tp2_pp2(tmp_path, qwen2_dir, llama_dir, cuda_env):
    cuda_env()
    run_job(2, "parity", tmp_path, qwen2_dir, llama_dir)
    result = json.loads((tmp_path / "parity.json").read_text())
    for family in ("qwen2", "llama"):
        for layout in ("tp1", "tp2", "pp2"):
            for rec in result[family][layout]:
                assert rec["bitwise_equal"], (family, layout, rec)
                if rec["is_output_rank"]:
                    assert rec["logits_max_abs_diff"] < 1e-4, (family, layout, rec)


@pytest.mark.gpu(1)
def test_gpu_train_step_and_offload(tmp_path, qwen2_dir, cuda_env):
    from transformers import AutoModelForCausalLM

    from tests.backends.megatron.reference import hf_train_step, sequence_batch

    cuda_env()
    lr = 1e-4
    run_job(1, "train", tmp_path, qwen2_dir, lr)
    records = {r["key"]: r for r in json.loads((tmp_path / "train_w1.json").read_text())}
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    batch = sequence_batch(7, vocab=model.config.vocab_size, seed=3).pad_to(8, zero=["loss_mask"])
    loss, _ = hf_train_step(model, batch, lr=lr, weight_decay=0.1, clip_grad=1.0, mode="token-mean",
                            with_entropy=True)
    assert abs(records["w1_tp1_pp1_dp1_mb4_token-mean"]["first"]["loss"] - loss) < 1e-4
    off = records["offload"]
    assert off["offloaded"] == pytest.approx(off["plain"], abs=1e-6)
    assert off["offload"] > off["grad_bytes"] > 0                    # optimizer state moved too
    assert off["released"] >= off["offload"] * 0.9                   # the allocator saw it go
    assert off["offload_params"] == off["param_bytes"] > 0 and off["released_params"] >= off["param_bytes"] * 0.9
    assert os.environ["HYBRIDRL_TEST_DEVICE"] == "cuda"
