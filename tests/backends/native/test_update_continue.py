"""on_weight_update=continue: a version published while requests run is applied between two engine steps;
each request keeps its tokens, its prefix is computed again under the new weights and its next tokens are
a new segment of the new version, with that version's logprobs (checked against transformers per version)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridrl.rollout.protocol import FinishReason, GenerationOutput, SamplingParams
from tests.backends.native.conftest import PARITY, hf_logprobs, prompts_of
from tests.backends.native.test_weights import hf_with, perturbed

pytestmark = pytest.mark.timeout(120)

SAMPLED = SamplingParams(max_new_tokens=14, temperature=1.0, ignore_eos=True)


async def _generate(engine, prompts, tag):
    return await asyncio.gather(*[engine.generate(p, SAMPLED, f"{tag}{i}") for i, p in enumerate(prompts)])


def _check_segments(outs, prompts, hf_by_version):
    """Every token's logprob is that of the version labelled on it (a transformers forward per version)."""
    for prompt, out in zip(prompts, outs):
        versions = out.versions
        for version, model in hf_by_version.items():
            where = [i for i, v in enumerate(versions) if v == version]
            if where:
                ref = hf_logprobs(model, prompt, out.token_ids)[where]
                torch.testing.assert_close(torch.tensor(out.logprobs)[where], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("driver", ["loop", "thread"])
def test_an_update_at_a_fixed_step_continues_every_request_as_a_new_segment(driver, tiny_models, hf_model,
                                                                            make_engine):
    model_dir = tiny_models("qwen2", **PARITY)
    engine = make_engine(model_dir, driver=driver, on_weight_update="continue")
    new = perturbed(engine, seed=3)
    prompts = prompts_of([9, 17, 30, 12], seed=4)

    async def go():
        await engine.hold_next_update(engine.steps + 6)
        await engine.update_weights(new[:10], 1)          # two buckets, staged while nothing has run
        await engine.update_weights(new[10:], 1)
        assert engine.policy_version == 0 and engine.staged_version == 1
        return await _generate(engine, prompts, "a")

    outs = asyncio.run(go())
    # every request was admitted in the first step, so 6 tokens each came from v0 and the rest from v1
    assert all(o.version_starts == ((6, 1),) and o.policy_version == 0 for o in outs)
    assert all(o.finish_reason == FinishReason.LENGTH and len(o.token_ids) == 14 for o in outs)
    _check_segments(outs, prompts, {0: hf_model(model_dir), 1: hf_with(hf_model(model_dir), new)})
    stats = engine.stats()
    assert engine.policy_version == 1 and stats["updates_mid_request"] == 1
    assert stats["update_continued_requests"] == 4 and stats["update_recompute_tokens"] == sum(map(len, prompts)) + 4 * 5
    assert stats["update_hold_s"] == 0.0                   # the weights were there before the step came


def test_the_engine_waits_at_the_step_until_the_weights_are_staged(tiny_models, hf_model, make_engine):
    """Thread driver: the engine reaches the update's step before the second bucket; it runs no step until
    it is staged, so the split is where it was fixed whatever the timing."""
    model_dir = tiny_models("qwen2", **PARITY)
    engine = make_engine(model_dir, driver="thread", on_weight_update="continue")
    new = perturbed(engine, seed=5)
    prompts = prompts_of([11, 23], seed=6)

    async def go():
        await engine.hold_next_update(engine.steps + 4)
        await engine.update_weights(new[:10], 1)
        running = asyncio.ensure_future(_generate(engine, prompts, "b"))
        while not await engine.run_in_engine(lambda core: core.held()):
            await asyncio.sleep(0.01)
        steps = engine.steps
        await asyncio.sleep(0.05)
        assert engine.steps == steps == 4                  # held: nothing generated while it waits
        await engine.update_weights(new[10:], 1)
        return await running

    outs = asyncio.run(go())
    assert all(o.version_starts == ((4, 1),) for o in outs)
    _check_segments(outs, prompts, {0: hf_model(model_dir), 1: hf_with(hf_model(model_dir), new)})
    stats = engine.stats()
    assert stats["update_hold_s"] >= 0.05                    # it waited at least the 50 ms above
    assert stats["update_late_steps"] >= 1                   # the steps it could have run meanwhile


def test_an_update_at_the_next_step_labels_every_token_with_the_version_that_sampled_it(tiny_models, hf_model,
                                                                                        make_engine):
    """No fixed step: the update lands wherever the requests are when it is staged (timing decides where,
    not what each token's label and logprob are). A request not yet started runs on the new version whole."""
    model_dir = tiny_models("qwen2", **PARITY)
    engine = make_engine(model_dir, driver="loop", on_weight_update="continue", max_num_seqs=2)
    new = perturbed(engine, seed=7)
    prompts = prompts_of([8, 14, 20], seed=8)

    async def go():
        running = asyncio.ensure_future(_generate(engine, prompts, "c"))
        while engine.steps < 3:
            await asyncio.sleep(0)
        await engine.update_weights(new, 1)
        await engine.serving(1)
        return await running

    outs = asyncio.run(go())
    assert [o.versions[0] for o in outs] == [0, 0, 1] and outs[2].version_starts == ()
    assert all(o.version_starts and o.version_starts[0][1] == 1 for o in outs[:2])
    _check_segments(outs, prompts, {0: hf_model(model_dir), 1: hf_with(hf_model(model_dir), new)})


def test_an_output_splits_into_one_segment_per_version():
    out = GenerationOutput(request_id="r", token_ids=[5, 6, 7, 8, 9], logprobs=[-.1, -.2, -.3, -.4, -.5],
                           finish_reason=FinishReason.STOP, policy_version=2, prompt_tokens=10,
                           version_starts=((2, 3), (4, 5)))
    assert out.versions == [2, 2, 3, 3, 5]
    parts = out.by_version()
    assert [p.token_ids for p in parts] == [[5, 6], [7, 8], [9]]
    assert [p.policy_version for p in parts] == [2, 3, 5] and [p.prompt_tokens for p in parts] == [10, 12, 14]
    assert [p.finish_reason for p in parts] == [FinishReason.WEIGHTS_UPDATED] * 2 + [FinishReason.STOP]
    assert [p.logprobs for p in parts] == [[-.1, -.2], [-.3, -.4], [-.5]]
    assert GenerationOutput("r", [1], [-.1], FinishReason.STOP, 0).by_version()[0].versions == [0]
    late = GenerationOutput("r", [1, 2], [-.1, -.2], FinishReason.ABORT, 0, version_starts=((2, 1),))   # no token after
    assert [(p.token_ids, p.policy_version, p.finish_reason) for p in late.by_version()] == [([1, 2], 0, FinishReason.ABORT)]
