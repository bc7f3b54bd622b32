"""The async engine: prefix sharing, many concurrent requests, sleep/wake, abort, event-loop life."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest
import torch

from hybridrl.rollout.protocol import FinishReason, RolloutEngine, SamplingParams
from tests.backends.native.conftest import PARITY, generate_all, hf_greedy, hf_logprobs, prompts_of

pytestmark = pytest.mark.timeout(120)

DRIVERS = pytest.mark.parametrize("driver", ["loop", "thread"])


def test_engine_satisfies_the_protocol(tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"))
    assert isinstance(engine, RolloutEngine)
    assert engine.eos_token_ids == (2, 0) and engine.max_model_len == 2048 and engine.policy_version == 0


@DRIVERS
def test_n_samples_compute_the_prompt_once(driver, tiny_models, make_engine):
    model_dir = tiny_models("llama", **PARITY)
    prompt = prompts_of([50], seed=1)[0]
    n = 8
    shared = make_engine(model_dir, driver=driver)
    outs = generate_all(shared, [prompt] * n, [SamplingParams(max_new_tokens=10, seed=s) for s in range(n)])
    stats = shared.stats()
    naive = n * len(prompt)
    # the prompt once, then one token per other sample (its logits are needed to sample)
    assert stats["prefill_tokens"] == len(prompt) + (n - 1)
    assert stats["prefill_tokens"] <= naive / n + n
    assert stats["prefix_hit_tokens"] == (n - 1) * (len(prompt) - 1)
    assert sum(o.cached_prompt_tokens for o in outs) == stats["prefix_hit_tokens"]
    assert len({tuple(o.token_ids) for o in outs}) > 1                   # different seeds, different samples
    # exact: every sample equals the same request on an engine that shares nothing
    alone = make_engine(model_dir, enable_prefix_caching=False)
    refs = generate_all(alone, [prompt] * n, [SamplingParams(max_new_tokens=10, seed=s) for s in range(n)])
    assert alone.stats()["prefill_tokens"] == naive
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)


def test_a_follow_up_turn_reuses_the_previous_turn(tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"), block_size=8)
    prompt = prompts_of([21], seed=2)[0]
    first = generate_all(engine, [prompt], SamplingParams(max_new_tokens=9, ignore_eos=True))[0]
    turn2 = prompt + first.token_ids + [7, 8, 9]                          # + an observation
    second = generate_all(engine, [turn2], SamplingParams(max_new_tokens=3, ignore_eos=True), tag="t2")[0]
    # everything the first request computed (prompt + all but its last sampled token) is reused
    assert second.cached_prompt_tokens == len(prompt) + len(first.token_ids) - 1


def test_a_request_going_on_from_tokens_it_has_draws_what_the_uninterrupted_one_drew(tiny_models, make_engine):
    """A lost replica's request sent again with the tokens and logprobs it had streamed back (`generated`): the
    answer holds them and goes on with the tokens of the uninterrupted request (sampled, seeded: each token's
    uniform is its output index's), on another engine with the same weights. Nothing to go on to is refused."""
    model = tiny_models("qwen2")
    prompt = prompts_of([13], seed=5)[0]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    whole = generate_all(make_engine(model), [prompt], sp)[0]
    other = make_engine(model)

    async def go_on(n, request_id):
        return await other.generate(prompt, sp, request_id, generated=(whole.token_ids[:n], whole.logprobs[:n]))

    for n in (1, 6, 15):
        out = asyncio.run(go_on(n, f"on-{n}"))
        assert out.token_ids == whole.token_ids and out.logprobs[:n] == whole.logprobs[:n]
        torch.testing.assert_close(out.logprobs, whole.logprobs, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="16 generated tokens leave nothing to generate"):
        asyncio.run(go_on(16, "done"))
    with pytest.raises(ValueError, match="2 generated tokens but 1 logprobs"):
        asyncio.run(other.generate(prompt, sp, "odd", generated=([3, 4], [-1.0])))


@DRIVERS
def test_64_concurrent_requests_with_arrivals_and_a_live_event_loop(driver, tiny_models, hf_model, make_engine):
    model_dir = tiny_models("llama", **PARITY)
    engine = make_engine(model_dir, max_num_seqs=16, max_num_batched_tokens=64, block_size=8, driver=driver)
    lengths = [1 + (7 * i) % 45 for i in range(64)]
    prompts = prompts_of(lengths, seed=3)
    budgets = [4 + (5 * i) % 17 for i in range(64)]
    ticks: list[int] = []       # the engine's step count whenever the loop ran the ticker

    async def ticker(stop: asyncio.Event):
        while not stop.is_set():
            await asyncio.sleep(0.002)
            ticks.append(engine.stats()["steps"])

    async def main():
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        tasks = []
        for i, (p, b) in enumerate(zip(prompts, budgets)):
            tasks.append(asyncio.create_task(
                engine.generate(p, SamplingParams(max_new_tokens=b, temperature=0.0), f"req-{i}")))
            if i % 8 == 7:
                await asyncio.sleep(0.01)                      # new requests keep arriving while others run
        outs = await asyncio.gather(*tasks)
        stop.set()
        await tick
        return outs

    started = time.perf_counter()
    outs = asyncio.run(main())
    elapsed = time.perf_counter() - started
    model = hf_model(model_dir)
    eos = set(engine.eos_token_ids)
    by_budget: dict[int, list[int]] = {}
    for i, b in enumerate(budgets):
        by_budget.setdefault(b, []).append(i)
    for b, rows in by_budget.items():
        refs = hf_greedy(model, [prompts[i] for i in rows], b, eos)
        for i, ref in zip(rows, refs):
            assert outs[i].token_ids == ref, f"request {i}"
    stats = engine.stats()
    assert stats["requests_finished"] == 64 and stats["kv_blocks_used"] == 0
    assert stats["requests_running"] == 0 and stats["requests_waiting"] == 0
    # the loop kept getting control while the engine computed: ticks in every third of the engine's steps.
    # Counted in steps, not seconds: on a loaded machine the process can be descheduled for a whole third of
    # the run's wall time, which says nothing about the engine; an engine that held the loop would leave
    # every tick at step 0 or at the last step.
    thirds = {int(3 * t / stats["steps"]) for t in ticks if 0 < t < stats["steps"]}
    assert len(ticks) > 10 and thirds == {0, 1, 2}, (ticks, stats["steps"], elapsed)


def _rss() -> int:
    return psutil.Process().memory_info().rss


@DRIVERS
def test_sleep_frees_the_kv_cache_and_wake_up_serves_again(driver, tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"), kv_cache_mb=96, driver=driver)
    prompt = prompts_of([12])[0]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = generate_all(engine, [prompt], greedy)[0]
    kv_bytes = engine.stats()["kv_cache_bytes"]
    assert kv_bytes == 96 * 2**20

    async def sleep_during_a_request():
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=2000, ignore_eos=True), "long"))
        while engine.stats()["requests_running"] == 0:
            await asyncio.sleep(0.001)
        rss_awake = _rss()
        await engine.sleep()
        return await task, rss_awake, _rss()

    aborted, rss_awake, rss_asleep = asyncio.run(sleep_during_a_request())
    assert aborted.finish_reason == FinishReason.ABORT and 0 < len(aborted.token_ids) < 2000
    assert engine.stats()["kv_cache_bytes"] == 0 and engine.stats()["asleep"]
    assert rss_awake - rss_asleep > 0.8 * kv_bytes                  # the process really gave the memory back
    with pytest.raises(RuntimeError, match="asleep"):
        generate_all(engine, [prompt], greedy)
    asyncio.run(engine.wake_up())
    assert _rss() - rss_asleep > 0.8 * kv_bytes
    after = generate_all(engine, [prompt], greedy, tag="again")[0]
    assert after.token_ids == before.token_ids and after.cached_prompt_tokens == 0


@DRIVERS
def test_abort_and_cancellation(driver, tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"), driver=driver)
    long = SamplingParams(max_new_tokens=100000 // 100, ignore_eos=True)

    async def main():
        task = asyncio.create_task(engine.generate([5, 6, 7], long, "a"))
        while engine.stats()["decode_tokens"] < 3:
            await asyncio.sleep(0.001)
        assert await engine.abort("a") is True
        out = await task
        assert await engine.abort("a") is False and await engine.abort("nobody") is False
        victim = asyncio.create_task(engine.generate([8, 9], long, "b"))
        await asyncio.sleep(0.05)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        for _ in range(1000):
            if engine.stats()["requests_aborted"] == 2:
                break
            await asyncio.sleep(0.001)
        return out

    out = asyncio.run(main())
    assert out.finish_reason == FinishReason.ABORT and len(out.token_ids) >= 3
    assert len(out.logprobs) == len(out.token_ids)
    stats = engine.stats()
    assert stats["requests_aborted"] == 2 and stats["requests_running"] == 0 and stats["kv_blocks_used"] == 0


@DRIVERS
def test_one_persistent_loop_stopped_between_phases(driver, tiny_models, make_engine):
    """The hybrid worker's pattern: loop.run_until_complete per rollout phase, the loop idle in between."""
    engine = make_engine(tiny_models("qwen2"), driver=driver)
    loop = asyncio.new_event_loop()
    try:
        sp = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
        first = loop.run_until_complete(engine.generate([3, 4, 5], sp, "p1"))
        background = loop.create_task(engine.generate([3, 4, 5, 6], sp, "p2"))   # left running across phases
        time.sleep(0.2)                                                           # loop stopped; engine works
        second = loop.run_until_complete(engine.generate([3, 4, 5], sp, "p3"))
        third = loop.run_until_complete(background)
    finally:
        loop.close()
    assert first.token_ids == second.token_ids and len(third.token_ids) == 5
    again = asyncio.run(engine.generate([3, 4, 5], sp, "p4"))                     # and a brand-new loop
    assert again.token_ids == first.token_ids


@DRIVERS
def test_bad_requests_are_refused_with_clear_errors(driver, tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"), max_model_len=16, driver=driver)
    sp = SamplingParams(max_new_tokens=4)

    async def main():
        with pytest.raises(ValueError, match="prompt is empty"):
            await engine.generate([], sp, "e")
        with pytest.raises(ValueError, match=r"token id 576 at position 1 is outside the vocabulary \[0, 576\)"):
            await engine.generate([1, 576], sp, "v")
        with pytest.raises(TypeError, match="SamplingParams"):
            await engine.generate([1], {"max_new_tokens": 3}, "t")
        task = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_new_tokens=10), "dup"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="'dup' is already in flight"):
            await engine.generate([1, 2], sp, "dup")
        await task
        too_long = await engine.generate(list(range(3, 19)), sp, "long")
        assert too_long.finish_reason == FinishReason.CONTEXT and too_long.token_ids == []

    asyncio.run(main())


def test_logprobs_of_concurrent_mixed_sampling(tiny_models, hf_model, make_engine):
    """Greedy, temperature and top-k/top-p requests decoded in the same batches keep exact logprobs."""
    model_dir = tiny_models("qwen2", **PARITY)
    engine = make_engine(model_dir, max_num_batched_tokens=16, max_num_seqs=8, block_size=4)
    prompts = prompts_of([9, 2, 27, 14], seed=9)
    params = [SamplingParams(max_new_tokens=12, temperature=0.0), SamplingParams(max_new_tokens=12, temperature=0.7),
              SamplingParams(max_new_tokens=12, temperature=1.2, top_k=5), SamplingParams(max_new_tokens=12, top_p=0.5)]
    outs = generate_all(engine, prompts, params)
    for prompt, out, sp in zip(prompts, outs, params):
        ref = hf_logprobs(hf_model(model_dir), prompt, out.token_ids, sp.temperature or 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)


@DRIVERS
def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(driver, tiny_models, make_engine):
    engine = make_engine(tiny_models("qwen2"), driver=driver)
    runner = engine.core.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected kernel failure")
        return real(plan)

    runner.execute = flaky
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with pytest.raises(RuntimeError, match="native engine step failed.*injected kernel failure"):
        generate_all(engine, [[3, 4, 5], [6, 7]], sp)
    stats = engine.stats()
    assert stats["requests_running"] == 0 and stats["kv_blocks_used"] == 0
    outs = generate_all(engine, [[3, 4, 5]], sp, tag="after")
    assert len(outs[0].token_ids) == 8


def test_a_kept_kv_cache_stays_allocated_asleep_and_its_old_blocks_are_never_reused(tiny_models, make_engine):
    """`keep_kv_cache`: a wake re-creates nothing, and the prefix blocks of before the sleep are forgotten."""
    engine = make_engine(tiny_models("qwen2"), kv_cache_mb=8, keep_kv_cache=True)
    prompt = prompts_of([12])[0]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    before = generate_all(engine, [prompt], greedy)[0]
    cache = engine._core.runner.kv_cache
    asyncio.run(engine.sleep())
    assert engine.stats()["asleep"] and engine.stats()["kv_cache_bytes"] == 8 * 2**20
    asyncio.run(engine.wake_up())
    assert engine._core.runner.kv_cache is cache
    again = generate_all(engine, [prompt], greedy, tag="again")[0]
    assert again.token_ids == before.token_ids and again.logprobs == before.logprobs
    assert again.cached_prompt_tokens == 0                # nothing of before the sleep was reused
