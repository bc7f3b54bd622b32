"""LoRA adapters applied at run time by the native engine, against the same adapters merged into the
weights of a plain engine (W + alpha / rank * B A per targeted projection, HF layout): the same greedy
tokens and logprobs, for every projection and for a subset; the engine's spec is the adapters' alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridrl.backends.native import NativeEngine, NativeEngineConfig
from hybridrl.backends.lora_names import PROJECTIONS, factor_name
from hybridrl.backends.native.lora import LoraSpec
from hybridrl.rollout.protocol import SamplingParams
from tests.backends.native.conftest import PARITY, generate_all, prompts_of

RANK, ALPHA = 4, 12.0


def _factors(engine, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) * 0.3 for name, (shape, _) in engine.weight_spec().items()}


@pytest.mark.parametrize("targets", [PROJECTIONS, ("q_proj", "v_proj", "down_proj")])
def test_run_time_adapters_equal_merged_weights(targets, tiny_models, make_engine):
    model = tiny_models("qwen2", **PARITY)
    lora = NativeEngine.from_pretrained(model, NativeEngineConfig(kv_cache_mb=8), lora=LoraSpec(RANK, ALPHA, targets))
    try:
        spec = lora.weight_spec()
        layers = lora.core.spec.num_layers
        assert sorted(spec) == sorted(factor_name(i, p, f) for i in range(layers) for p in targets for f in "AB")
        factors = _factors(lora)
        asyncio.run(lora.update_weights(list(factors.items()), 1))
        merged = make_engine(model)
        updates, touched = [], 0
        for name in merged.weight_spec():                   # the whole model (a version needs every tensor)
            module, weight = name.removesuffix(".weight"), merged.core.base_views[name].clone()
            a, b = f"{module}.lora_A.weight", f"{module}.lora_B.weight"
            if a in factors:
                weight += (ALPHA / RANK) * factors[b] @ factors[a]
                touched += 1
            updates.append((name, weight))
        assert touched == layers * len(targets)
        asyncio.run(merged.update_weights(updates, 1))
        prompts = prompts_of([5, 9, 3])
        sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        got, want = generate_all(lora, prompts, sampling), generate_all(merged, prompts, sampling)
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            assert max(abs(x - y) for x, y in zip(g.logprobs, w.logprobs)) < 1e-4
        base = generate_all(make_engine(model), prompts, sampling)
        assert max(abs(x - y) for g, b in zip(got, base) for x, y in zip(g.logprobs, b.logprobs)) > 1e-2
    finally:
        lora.close()


def test_a_whole_model_is_no_update_of_an_adapter_engine(tiny_models):
    model = tiny_models("qwen2", **PARITY)
    lora = NativeEngine.from_pretrained(model, NativeEngineConfig(kv_cache_mb=8), lora=LoraSpec(RANK, ALPHA, PROJECTIONS))
    try:
        with pytest.raises(ValueError, match="unknown tensor"):
            asyncio.run(lora.update_weights([("model.norm.weight", lora.core.base_views["model.norm.weight"])], 1))
        name = factor_name(0, "q_proj", "A")
        with pytest.raises(ValueError, match=f"'{name}' has shape"):
            asyncio.run(lora.update_weights([(name, torch.zeros(RANK + 1, 7))], 1))
        assert lora.policy_version == 0
    finally:
        lora.close()
