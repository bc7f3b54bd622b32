"""The rollout-engine contract, written once and run against every backend.

A backend's test module subclasses `EngineContract` as `Test<Backend>Contract` and provides the
fixture `make_engine(model_dir) -> engine` (closed afterwards). Everything here goes through the
`RolloutEngine` protocol only; the references are transformers' forward and `generate` on the
same HF directory, in float32.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from hybridrl.rollout.protocol import FinishReason, RolloutEngine, SamplingParams
from tests.backends.native.conftest import hf_greedy, hf_logprobs, prompts_of

def checkpoint_tensors(model_dir: Path, dtype: torch.dtype, device: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    out = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out += [(name, t.to(device=device, dtype=dtype)) for name, t in sorted(load_file(str(path)).items())]
    return out


def on_loop(engine, coro):
    """Run `coro` on the engine's one event loop: SGLang's tokenizer manager binds to the first loop that
    uses it, so an engine is driven from one loop for its whole life (as the hybrid worker does)."""
    loop = getattr(engine, "_contract_loop", None)
    if loop is None:
        loop = engine._contract_loop = asyncio.new_event_loop()
    return loop.run_until_complete(coro)


def run(engine, prompts, sampling, tag="r"):
    async def go():
        return await asyncio.gather(*[engine.generate(p, sampling, f"{tag}{i}") for i, p in enumerate(prompts)])

    return on_loop(engine, go())


class EngineContract:
    model_spec: dict = {"init_std": 0.1}      # tiny_models(arch, **model_spec): logits far from flat
    weights_device = "cpu"                    # where update_weights' tensors live
    logprob_atol = 1e-4

    @pytest.fixture
    def model_dir(self, tiny_models):
        return tiny_models("qwen2", **self.model_spec)

    def test_satisfies_the_protocol(self, make_engine, model_dir):
        engine = make_engine(model_dir)
        assert isinstance(engine, RolloutEngine)
        assert engine.policy_version == 0

    def test_greedy_equals_transformers_generate(self, hf_model, make_engine, model_dir):
        engine = make_engine(model_dir)
        prompts = prompts_of([3, 17, 40, 1, 9], seed=1)
        outs = run(engine, prompts, SamplingParams(max_new_tokens=16, temperature=0.0))
        expected = hf_greedy(hf_model(model_dir), prompts, 16, set(engine.eos_token_ids))
        for out, ref in zip(outs, expected):
            assert out.token_ids == ref
            assert out.finish_reason == (FinishReason.STOP if ref[-1] in engine.eos_token_ids else FinishReason.LENGTH)
            assert out.policy_version == 0

    @pytest.mark.parametrize("temperature", [0.0, 0.7])
    def test_logprobs_follow_the_sampler_contract(self, hf_model, make_engine, model_dir, temperature):
        """The logprob of each sampled token is log_softmax(logits / T) at that token (T = 1 greedy)."""
        engine = make_engine(model_dir)
        prompts = prompts_of([5, 33, 12], seed=2)
        outs = run(engine, prompts, SamplingParams(max_new_tokens=12, temperature=temperature, seed=7))
        for prompt, out in zip(prompts, outs):
            assert len(out.logprobs) == len(out.token_ids) > 0
            ref = hf_logprobs(hf_model(model_dir), prompt, out.token_ids, temperature or 1.0)
            torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=self.logprob_atol, rtol=0)

    def test_update_weights_switches_the_version_only_when_every_tensor_arrived(self, hf_model, make_engine,
                                                                                  model_dir, tiny_models):
        engine = make_engine(model_dir)
        other = tiny_models("qwen2", **{**self.model_spec, "seed": 11})
        dtype = next(iter(engine.weight_spec().values()))[1]
        new = checkpoint_tensors(other, dtype, self.weights_device)
        prompt = prompts_of([20], seed=3)[0]
        greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
        half = len(new) // 2
        on_loop(engine, engine.update_weights(new[:half], 1))
        assert engine.policy_version == 0
        on_loop(engine, engine.update_weights(new[half:], 1))
        assert engine.policy_version == 1
        out = run(engine, [prompt], greedy)[0]
        assert out.policy_version == 1
        assert out.token_ids == hf_greedy(hf_model(other), [prompt], 10, set())[0]
        ref = hf_logprobs(hf_model(other), prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=self.logprob_atol, rtol=0)

    def test_a_bad_update_is_refused_whole_and_changes_nothing(self, make_engine, model_dir, tiny_models):
        engine = make_engine(model_dir)
        prompt = prompts_of([15], seed=4)[0]
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        before = run(engine, [prompt], greedy)[0]
        dtype = next(iter(engine.weight_spec().values()))[1]
        new = checkpoint_tensors(tiny_models("qwen2", **{**self.model_spec, "seed": 12}), dtype, self.weights_device)
        name, t = new[-1]
        for bad, message in (([*new[:-1], (name, t[..., :-1])], "shape"),
                             ([*new[:-1], (name, t.double())], "dtype"),
                             ([*new, ("model.layers.99.mlp.up_proj.weight", t)], "unknown")):
            with pytest.raises((ValueError, TypeError), match=message):
                on_loop(engine, engine.update_weights(bad, 1))
        assert engine.policy_version == 0
        after = run(engine, [prompt], greedy, tag="after")[0]
        assert (after.token_ids, after.policy_version) == (before.token_ids, 0)
        # the same weights (a cached prefix may round differently in the last bit)
        torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(before.logprobs), atol=1e-5, rtol=0)

    def test_sleep_aborts_what_runs_and_wake_up_serves_the_same(self, make_engine, model_dir):
        engine = make_engine(model_dir)
        prompt = prompts_of([12], seed=5)[0]
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        before = run(engine, [prompt], greedy)[0]

        async def sleep_during_a_request():
            task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=1500, ignore_eos=True),
                                                       "long"))
            await asyncio.sleep(0.2)
            await engine.sleep()
            return await task

        aborted = on_loop(engine, sleep_during_a_request())
        assert aborted.finish_reason == FinishReason.ABORT and len(aborted.token_ids) < 1500
        with pytest.raises(RuntimeError, match="asleep"):
            run(engine, [prompt], greedy)
        on_loop(engine, engine.wake_up())
        again = run(engine, [prompt], greedy, tag="again")[0]
        assert again.token_ids == before.token_ids

    def test_abort_ends_a_request_with_abort(self, make_engine, model_dir):
        engine = make_engine(model_dir)

        async def main():
            task = asyncio.create_task(engine.generate([5, 6, 7], SamplingParams(max_new_tokens=1500, ignore_eos=True),
                                                       "a"))
            await asyncio.sleep(0.2)
            assert await engine.abort("a") is True
            out = await task
            assert await engine.abort("a") is False and await engine.abort("nobody") is False
            return out

        out = on_loop(engine, main())
        assert out.finish_reason == FinishReason.ABORT and len(out.token_ids) < 1500
        assert len(out.logprobs) == len(out.token_ids)
