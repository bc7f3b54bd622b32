"""The native engine on CUDA (skipped without a GPU): parity in float32, bfloat16 serving, memory release."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridrl.backends.native import NativeEngine, NativeEngineConfig
from hybridrl.rollout.protocol import SamplingParams
from tests.backends.native.conftest import PARITY, hf_greedy, hf_logprobs, prompts_of

pytestmark = [pytest.mark.gpu(1), pytest.mark.timeout(300)]


def _run(engine, prompts, sp):
    async def go():
        return await asyncio.gather(*[engine.generate(p, sp, f"g{i}") for i, p in enumerate(prompts)])
    return asyncio.run(go())


def test_cuda_float32_matches_transformers_and_sleep_releases_memory(tiny_models, hf_model):
    model_dir = tiny_models("llama", **PARITY)
    engine = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(kv_cache_mb=64, dtype="float32"), device="cuda")
    try:
        assert engine.driver == "thread"
        prompts = prompts_of([3, 17, 40, 9], seed=1)
        outs = _run(engine, prompts, SamplingParams(max_new_tokens=16, temperature=0.0))
        refs = hf_greedy(hf_model(model_dir), prompts, 16, set(engine.eos_token_ids))
        assert [o.token_ids for o in outs] == refs
        sampled = _run(engine, prompts, SamplingParams(max_new_tokens=16, temperature=0.7, seed=3))
        for p, o in zip(prompts, sampled):
            ref = hf_logprobs(hf_model(model_dir), p, o.token_ids, 0.7)
            torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)
        before = torch.cuda.memory_allocated()
        asyncio.run(engine.sleep())
        assert before - torch.cuda.memory_allocated() >= 64 * 2**20
        asyncio.run(engine.wake_up())
        again = _run(engine, prompts[:1], SamplingParams(max_new_tokens=16, temperature=0.0))
        assert again[0].token_ids == refs[0]
    finally:
        engine.close()


def test_cuda_bfloat16_serves_with_close_logprobs(tiny_models, hf_model):
    model_dir = tiny_models("qwen2", **PARITY)
    engine = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(kv_cache_mb=64), device="cuda")
    try:
        assert engine.weight_spec()["model.norm.weight"][1] == torch.bfloat16
        prompts = prompts_of([5, 30], seed=2)
        outs = _run(engine, prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=4))
        for p, o in zip(prompts, outs):
            ref = hf_logprobs(hf_model(model_dir), p, o.token_ids)
            assert (torch.tensor(o.logprobs) - ref).abs().max() < 0.1     # bf16 weights vs fp32 reference
    finally:
        engine.close()
