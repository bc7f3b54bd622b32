"""update_weights: validation before any copy, in-place copies, versions, requests in flight, prefix cache."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from hybridrl.rollout.protocol import FinishReason, SamplingParams
from tests.backends.native.conftest import PARITY, generate_all, hf_logprobs, prompts_of

pytestmark = pytest.mark.timeout(120)


def perturbed(engine, seed=0, scale=0.05) -> list[tuple[str, torch.Tensor]]:
    """New weights for every tensor of the engine's spec (its current values + seeded noise)."""
    g = torch.Generator().manual_seed(seed)
    current = asyncio.run(engine.run_in_engine(lambda core: {n: v.clone() for n, v in core.views.items()}))
    return [(name, current[name] + scale * torch.randn(shape, generator=g))
            for name, (shape, _) in sorted(engine.weight_spec().items())]


def hf_with(model, named) -> torch.nn.Module:
    other = copy.deepcopy(model)
    state = dict(named)
    missing, unexpected = other.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}      # tied head follows the embedding
    return other


def snapshot(engine) -> dict[str, torch.Tensor]:
    return asyncio.run(engine.run_in_engine(lambda core: {n: v.clone() for n, v in core.views.items()}))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_weight_spec_is_the_hf_state_dict(arch, tiny_models, hf_model, make_engine):
    model_dir = tiny_models(arch)
    engine = make_engine(model_dir)
    hf = hf_model(model_dir)
    expected = {n: (tuple(t.shape), t.dtype) for n, t in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert engine.weight_spec() == expected


def test_a_bad_call_names_the_tensor_and_changes_nothing(tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"))
    good = perturbed(engine)
    before = snapshot(engine)
    name, tensor = good[7]
    cases = [
        (good[:5] + [("model.layers.9.mlp.up_proj.weight", tensor)], r"unknown tensor\(s\): \['model.layers.9.mlp.up_proj.weight'\]"),
        (good[:5] + [("lm_head.weight", tensor)], "ties lm_head to model.embed_tokens.weight"),
        (good[:5] + [(name, tensor[:-1])], f"tensor '{name}' has shape"),
        (good[:5] + [(name, tensor.double())], f"tensor '{name}' has dtype float64, expected float32"),
        (good[:5] + [good[0]], "appears twice"),
    ]
    for items, message in cases:
        with pytest.raises(ValueError, match=message):
            asyncio.run(engine.update_weights(items, 1))
    after = snapshot(engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert engine.policy_version == 0 and engine.stats()["pending_version"] is None
    asyncio.run(engine.update_weights(good, 3))
    assert engine.policy_version == 3
    with pytest.raises(ValueError, match=r"version 2 is older than the current policy \(version 3\)"):
        asyncio.run(engine.update_weights(good[:1], 2))
    assert engine.policy_version == 3 and engine.stats()["pending_version"] is None


@pytest.mark.parametrize("driver", ["loop", "thread"])
def test_bucketed_update_switches_version_only_when_complete(driver, tiny_models, hf_model, make_engine):
    model_dir = tiny_models("llama", **PARITY)
    engine = make_engine(model_dir, driver=driver)
    hf_old = hf_model(model_dir)
    prompt = prompts_of([20], seed=1)[0]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    old = generate_all(engine, [prompt], greedy)[0]
    assert old.policy_version == 0
    new = perturbed(engine, seed=1, scale=0.2)
    ptrs = asyncio.run(engine.run_in_engine(lambda core: {n: v.data_ptr() for n, v in core.views.items()}))
    half = len(new) // 2

    async def stream():
        await engine.update_weights(new[:half], 1)
        assert engine.policy_version == 0 and engine.stats()["pending_version"] == 1
        waiting = asyncio.create_task(engine.generate(prompt, greedy, "during"))
        await asyncio.sleep(0.1)
        assert not waiting.done()                       # nothing is generated from a half-updated model
        await engine.update_weights(new[half:], 1)
        return await waiting

    during = asyncio.run(stream())
    assert engine.policy_version == 1 and during.policy_version == 1
    assert during.cached_prompt_tokens == 0             # the prefix cache of version 0 was dropped
    ref = hf_logprobs(hf_with(hf_old, new), prompt, during.token_ids)
    torch.testing.assert_close(torch.tensor(during.logprobs), ref, atol=1e-4, rtol=0)
    assert during.token_ids != old.token_ids
    assert ptrs == asyncio.run(engine.run_in_engine(lambda core: {n: v.data_ptr() for n, v in core.views.items()}))
    stats = engine.stats()
    assert stats["weight_updates"] == 1 and stats["prefix_cache_invalidations"] == 2


@pytest.mark.parametrize("driver", ["loop", "thread"])
@pytest.mark.parametrize("policy", ["drain", "abort"])
def test_requests_in_flight_during_an_update(policy, driver, tiny_models, hf_model, make_engine):
    model_dir = tiny_models("llama", **PARITY)
    engine = make_engine(model_dir, on_weight_update=policy, driver=driver)
    hf_old = hf_model(model_dir)
    prompt = prompts_of([10], seed=2)[0]
    new = perturbed(engine, seed=2, scale=0.2)
    long = SamplingParams(max_new_tokens=300, temperature=0.7, ignore_eos=True, seed=1)

    async def main():
        inflight = asyncio.create_task(engine.generate(prompt, long, "old"))
        while engine.stats()["decode_tokens"] < 5:
            await asyncio.sleep(0.001)
        await engine.update_weights(new, 1)
        fresh = await engine.generate(prompt, SamplingParams(max_new_tokens=4), "new")
        return await inflight, fresh

    old, fresh = asyncio.run(main())
    assert old.policy_version == 0 and fresh.policy_version == 1
    if policy == "drain":
        assert old.finish_reason == FinishReason.LENGTH and len(old.token_ids) == 300
    else:
        assert old.finish_reason == FinishReason.WEIGHTS_UPDATED and 5 <= len(old.token_ids) < 300
    # every token of the old request was generated with the old weights
    ref = hf_logprobs(hf_old, prompt, old.token_ids, 0.7)
    torch.testing.assert_close(torch.tensor(old.logprobs), ref, atol=1e-4, rtol=0)


def test_a_newer_version_supersedes_an_incomplete_one_and_updates_work_asleep(tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"))
    v1, v2 = perturbed(engine, seed=3), perturbed(engine, seed=4)
    asyncio.run(engine.sleep())
    asyncio.run(engine.update_weights(v1[:3], 1))
    asyncio.run(engine.update_weights(v1[:3], 1))              # a bucket sent twice: still incomplete
    assert engine.policy_version == 0 and engine.stats()["pending_version"] == 1
    with pytest.raises(ValueError, match="older than an update in progress"):
        asyncio.run(engine.update_weights(v1[3:], 0))
    asyncio.run(engine.update_weights(v2[:4], 2))              # supersedes the rest of version 1
    asyncio.run(engine.update_weights(v2[4:], 2))
    assert engine.policy_version == 2 and engine.stats()["pending_version"] is None
    after = snapshot(engine)
    assert all(torch.equal(after[n], t) for n, t in v2)
    asyncio.run(engine.wake_up())
    out = generate_all(engine, [[3, 4, 5]], SamplingParams(max_new_tokens=3))[0]
    assert out.policy_version == 2 and len(out.token_ids) > 0


def test_non_finite_weights_fail_requests_instead_of_returning_garbage(tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"))
    name = "model.norm.weight"
    shape, dtype = engine.weight_spec()[name]
    rest = [(n, t) for n, t in perturbed(engine, scale=0.0) if n != name]
    asyncio.run(engine.update_weights(rest + [(name, torch.full(shape, float("nan"), dtype=dtype))], 1))
    with pytest.raises(RuntimeError, match="non-finite logits"):
        generate_all(engine, [[3, 4, 5]], SamplingParams(max_new_tokens=4))
    assert engine.stats()["kv_blocks_used"] == 0
