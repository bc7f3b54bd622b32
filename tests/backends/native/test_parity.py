"""The engine against transformers: greedy ids, logprobs, and sampled ids under the sampler contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.rollout.protocol import FinishReason, SamplingParams
from tests.backends.native.conftest import PARITY, generate_all, hf_greedy, hf_logprobs, prompts_of

pytestmark = pytest.mark.timeout(120)

MIXED = [3, 17, 40, 1, 70, 9]


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("budget, block_size", [(512, 16), (16, 4)], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_equals_transformers_generate(arch, budget, block_size, kernels, tiny_models, hf_model, make_engine):
    model_dir = tiny_models(arch, **PARITY)
    engine = make_engine(model_dir, max_num_batched_tokens=budget, block_size=block_size, max_num_seqs=8,
                         kernels=kernels)
    prompts = prompts_of(MIXED, seed=1)
    outs = generate_all(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    expected = hf_greedy(hf_model(model_dir), prompts, 24, set(engine.eos_token_ids))
    for out, ref in zip(outs, expected):
        assert out.token_ids == ref
        assert out.finish_reason == (FinishReason.STOP if ref[-1] in engine.eos_token_ids else FinishReason.LENGTH)
        assert out.policy_version == 0 and out.prompt_tokens > 0
    if budget == 16:
        assert engine.stats()["steps"] > 24         # prompts were prefilled over several steps


@pytest.mark.parametrize("kernels", ["c", "torch"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (0.7, 1.0), (0.7, 0.8)])
def test_logprobs_equal_transformers_log_softmax(arch, temperature, top_p, kernels, tiny_models, hf_model,
                                                 make_engine):
    model_dir = tiny_models(arch, **PARITY)
    engine = make_engine(model_dir, max_num_batched_tokens=32, block_size=8, max_num_seqs=8, kernels=kernels)
    prompts = prompts_of([5, 33, 12], seed=2)
    sampling = SamplingParams(max_new_tokens=20, temperature=temperature, top_p=top_p, seed=7)
    outs = generate_all(engine, prompts, sampling)
    model = hf_model(model_dir)
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.token_ids) > 0
        # contract: log_softmax(logits / T) over the full vocabulary, T = 1 for greedy, before top-p
        ref = hf_logprobs(model, prompt, out.token_ids, temperature if temperature > 0 else 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


def _splitmix64_uniform(seed: int, index: int) -> float:
    """The contract's uniform, written from its definition (SplitMix64, top 50 bits)."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1)) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return ((z >> 14) + 0.5) / 2.0 ** 50


def test_sampled_ids_follow_the_contract_on_transformers_logits(tiny_models, hf_model, make_engine):
    """Replaying the draw with transformers' logits and warpers reproduces every sampled id."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    model_dir = tiny_models("llama", **PARITY)
    engine = make_engine(model_dir)
    prompts = prompts_of([6, 21], seed=3)
    params = [SamplingParams(max_new_tokens=16, temperature=0.8, top_k=40, top_p=0.9, seed=11),
              SamplingParams(max_new_tokens=16, temperature=1.3, seed=12)]
    outs = generate_all(engine, prompts, params)
    model = hf_model(model_dir)
    for prompt, out, sp in zip(prompts, outs, params):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float() / sp.temperature
        if sp.top_k > 0:
            logits = TopKLogitsWarper(sp.top_k)(None, logits)
        if sp.top_p < 1:
            logits = TopPLogitsWarper(sp.top_p)(None, logits)
        probs = torch.softmax(logits, dim=-1).double().numpy()
        for i, token in enumerate(out.token_ids):
            cdf = np.cumsum(probs[i])
            drawn = int(np.searchsorted(cdf, _splitmix64_uniform(sp.seed, i) * cdf[-1], side="right"))
            assert drawn == token, f"token {i}: contract draw {drawn}, engine {token}"


def test_batch_composition_does_not_change_a_seeded_sample(tiny_models, make_engine):
    model_dir = tiny_models("llama", **PARITY)
    alone = make_engine(model_dir)
    crowded = make_engine(model_dir, max_num_batched_tokens=24, block_size=4, max_num_seqs=8)
    prompt = prompts_of([13], seed=4)[0]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5)
    ref = generate_all(alone, [prompt], sp)[0]
    others = prompts_of([30, 2, 45, 8], seed=5)
    outs = generate_all(crowded, others + [prompt], [SamplingParams(max_new_tokens=20, temperature=0.9)] * 4 + [sp])
    assert outs[-1].token_ids == ref.token_ids
    torch.testing.assert_close(torch.tensor(outs[-1].logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["llama-biases-llama3-rope", "qwen2-untied-head-dim"])
def test_config_variants_match_transformers(variant, tmp_path, make_engine):
    """Llama with attention/MLP biases and llama3 RoPE scaling; Qwen2 with an untied head and an explicit
    head_dim: the engine reads each from config.json and matches transformers' logprobs."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

    from hybridrl.assets.tiny_model import TinyModelSpec, randomize_

    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, max_position_embeddings=512, eos_token_id=2, pad_token_id=0)
    if variant.startswith("llama"):
        config = LlamaConfig(**common, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
    else:
        config = Qwen2Config(**common, head_dim=24, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_(model, TinyModelSpec(init_std=0.1, seed=1))
    model.generation_config = GenerationConfig(eos_token_id=2, pad_token_id=0)
    model.save_pretrained(tmp_path)
    engine = make_engine(tmp_path)
    spec = engine.core.spec
    if variant.startswith("llama"):
        assert spec.rope_type == "llama3" and spec.qkv_bias and spec.o_bias and spec.mlp_bias
    else:
        assert spec.head_dim == 24 and not spec.tie_word_embeddings
    prompt = prompts_of([150], vocab=300, seed=8)[0]                 # past original_max_position_embeddings
    out = generate_all(engine, [prompt], SamplingParams(max_new_tokens=12, temperature=0.9, seed=2,
                                                        ignore_eos=True))[0]
    ref = hf_logprobs(model, prompt, out.token_ids, 0.9)
    torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
