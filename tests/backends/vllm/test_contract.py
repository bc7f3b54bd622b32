"""The vLLM engine against the shared rollout-engine contract (tests/rollout/engine_contract.py), and what
is particular to it: the sampler contract's refusals, seeds, memory tags on CPU, the parity probe, and a
damaged copy inside vLLM's own storage caught by the read-back. One engine serves the whole module.

Runs in the vLLM venv (`make test-vllm`); skipped where vllm is not importable (the main venv)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridrl.rollout.protocol import FinishReason, SamplingParams
from tests.backends.native.conftest import hf_logprobs, prompts_of
from tests.backends.vllm.conftest import MODEL_SPEC, reset
from tests.backends.vllm.faults import damage_after_copy
from tests.rollout.engine_contract import EngineContract, checkpoint_tensors, on_loop, run

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture
def make_engine(shared_engine):
    return lambda model_dir: reset(shared_engine, model_dir)


class TestVLLMContract(EngineContract):
    model_spec = MODEL_SPEC            # vLLM's CPU attention wants head sizes of 32 and up

    def test_sleep_aborts_what_runs_and_wake_up_serves_the_same(self, make_engine, model_dir):
        """On CPU vLLM has no sleep mode: the engine releases nothing (and says so), and `sleep` with no tag
        still ends the requests in flight with ABORT; it then serves the same as before."""
        engine = make_engine(model_dir)
        assert engine.releasable_tags == frozenset()
        with pytest.raises(ValueError, match="cannot release \\['kv_cache'\\]"):
            on_loop(engine, engine.sleep())
        prompt = prompts_of([12], seed=5)[0]
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        before = run(engine, [prompt], greedy)[0]

        async def sleep_during_a_request():
            task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=1500, ignore_eos=True),
                                                       "long"))
            await asyncio.sleep(0.5)
            await engine.sleep(())
            return await task

        aborted = on_loop(engine, sleep_during_a_request())
        assert aborted.finish_reason == FinishReason.ABORT and len(aborted.token_ids) < 1500
        assert len(aborted.logprobs) == len(aborted.token_ids)
        on_loop(engine, engine.wake_up(()))
        assert run(engine, [prompt], greedy, tag="again")[0].token_ids == before.token_ids


@pytest.fixture
def engine(shared_engine, vllm_model):
    return reset(shared_engine, vllm_model)


def test_top_k_or_top_p_with_sampling_is_refused_naming_the_keys(engine):
    for sampling in (SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.7, top_p=0.9)):
        with pytest.raises(ValueError, match="agent.top_k=-1 and agent.top_p=1.0"):
            run(engine, [[5, 6, 7]], sampling)
    greedy = run(engine, [[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0, top_k=5, ignore_eos=True))
    assert len(greedy[0].token_ids) == 4                  # greedy ignores the filters: nothing to refuse


def test_a_seeded_sample_does_not_depend_on_what_shares_its_batch(engine):
    """vLLM honours per-request seeds: a torch.Generator per seeded request."""
    prompt = prompts_of([9], seed=6)[0]
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run(engine, [prompt], sampling, tag="alone")[0]
    others = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]

    async def batch():
        return await asyncio.gather(engine.generate(prompt, sampling, "mine"),
                                    *[engine.generate(p, s, f"o{i}") for i, (p, s) in
                                      enumerate(zip(prompts_of([5, 7, 11], seed=8), others))])

    together = on_loop(engine, batch())[0]
    assert together.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(together.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    other_seed = run(engine, [prompt], SamplingParams(max_new_tokens=12, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone.token_ids


def test_stop_tokens_end_a_request_and_are_kept(engine):
    prompt = prompts_of([10], seed=9)[0]
    free = run(engine, [prompt], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop = free.token_ids[3]
    out = run(engine, [prompt], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=(stop,)), tag="s")[0]
    cut = free.token_ids.index(stop) + 1
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == FinishReason.STOP


def test_the_parity_probe_matches_transformers(engine, vllm_model, hf_model):
    """The probe a publication runs (greedy from fixed prefixes): vLLM's logprobs vs transformers'."""
    from hybridrl.publication import parity

    prompts = parity.probe_prompts(engine.vocab_size, 2, avoid=engine.eos_token_ids)
    outputs = on_loop(engine, parity.engine_outputs(engine, prompts, 8, tag="v0"))
    ref = torch.zeros(len(prompts), max(len(p) + 8 for p in prompts))
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        ref[b, len(p): len(p) + len(o.token_ids)] = hf_logprobs(hf_model(vllm_model), p, o.token_ids)
    result = parity.compare(prompts, outputs, ref)
    assert result["parity/tokens"] == 16 and result["parity/max_abs"] < 1e-4


def test_the_weight_spec_is_the_checkpoint_less_the_tied_lm_head(engine, vllm_model):
    spec = engine.weight_spec()
    names = {n for n, _ in checkpoint_tensors(vllm_model, torch.float32, "cpu")}
    assert set(spec) == names - {"lm_head.weight"} and "model.layers.0.self_attn.q_proj.weight" in spec
    assert spec["model.layers.0.self_attn.k_proj.weight"] == ((64, 128), torch.float32)


def test_a_damaged_copy_inside_vllm_is_caught_and_the_version_does_not_switch(engine, tiny_models, hf_model):
    from hybridrl.backends.vllm.transport import BucketRpcTransport
    from hybridrl.publication.buckets import FlatBucket, plan_buckets
    from hybridrl.rollout.weight_spec import WeightMismatch

    other = tiny_models("qwen2", **{**MODEL_SPEC, "seed": 21})
    spec = engine.weight_spec()
    new = {n: t for n, t in checkpoint_tensors(other, torch.float32, "cpu") if n in spec}
    plans = plan_buckets([[(n, tuple(t.shape), t.dtype)] for n, t in new.items()], 1 << 30)
    bucket = FlatBucket(plans[0], torch.empty(plans[0].nbytes, dtype=torch.uint8))
    for name, view in bucket.views.items():
        view.copy_(new[name])
    target = "model.layers.1.mlp.down_proj.weight"
    transport = BucketRpcTransport(engine)
    engine.call_worker(damage_after_copy, target, 1)
    with pytest.raises(WeightMismatch) as caught:
        on_loop(engine, transport.send(bucket, 1, digests=bucket.digests()))
    assert caught.value.names == [target]
    assert engine.policy_version == 0 and engine.stats()["pending_version"] == 1
    on_loop(engine, transport.send(bucket, 1, names=[target], digests=bucket.digests([target])))    # the retry
    assert engine.policy_version == 1
    prompt = prompts_of([14], seed=10)[0]
    out = run(engine, [prompt], SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), tag="d")[0]
    assert out.policy_version == 1
    torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs(hf_model(other), prompt, out.token_ids),
                               atol=1e-4, rtol=0)
    engine.call_worker(damage_after_copy, target, 0)
