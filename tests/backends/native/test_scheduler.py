"""Continuous batching on the synchronous core: chunked prefill, preemption, admission, finish reasons."""

from __future__ import annotations

import pytest
import torch

from hybridrl.backends.native import NativeEngineConfig
from hybridrl.backends.native.attention import split_by_width
from hybridrl.backends.native.core import EngineCore
from hybridrl.rollout.protocol import FinishReason, SamplingParams
from tests.backends.native.conftest import PARITY, prompts_of

pytestmark = pytest.mark.timeout(120)


def make_core(model_dir, **cfg) -> EngineCore:
    return EngineCore.from_pretrained(model_dir, NativeEngineConfig(**{"kv_cache_mb": 8, **cfg}),
                                      device=torch.device("cpu"))


def run(core: EngineCore, prompts, params, *, on_step=None, max_steps=5000):
    """Add every request, step until all are done; returns the finished sequences in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [core.make_sequence(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    for seq in seqs:
        core.add(seq)
    with torch.no_grad():
        for _ in range(max_steps):
            if not core.has_work():
                break
            core.step()
            if on_step is not None:
                on_step(core)
    assert all(s.finish_reason is not None for s in seqs), "requests left unfinished"
    return seqs


def test_chunked_prefill_does_not_block_decodes(tiny_models):
    core = make_core(tiny_models("llama", **PARITY), max_num_batched_tokens=16, max_num_seqs=8, block_size=4)
    short = core.make_sequence(prompts_of([4])[0], SamplingParams(max_new_tokens=60, ignore_eos=True), "short")
    core.add(short)
    with torch.no_grad():
        core.step()
        assert short.num_generated == 1
        long = core.make_sequence(prompts_of([100], seed=1)[0], SamplingParams(max_new_tokens=2, ignore_eos=True),
                                  "long")
        core.add(long)
        steps = 0
        while long.num_generated == 0:
            before = (short.num_generated, long.num_computed)
            core.step()
            steps += 1
            assert short.num_generated == before[0] + 1            # the decode ran in every step
            assert long.num_computed - before[1] <= 15              # the prompt went in chunks of the budget
    assert steps >= 100 // 15


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_under_a_small_cache_keeps_outputs_exact(tiny_models, caching):
    model_dir = tiny_models("llama", **PARITY)
    prompts = prompts_of([10, 3, 17, 8, 12, 5], seed=2)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i)
              for i in range(len(prompts))]
    reference = run(make_core(model_dir), prompts, params)
    small = make_core(model_dir, num_blocks=24, block_size=4, enable_prefix_caching=caching, watermark_blocks=0)
    peak = []
    seqs = run(small, prompts, params, on_step=lambda c: peak.append(c.pool.num_used))
    stats = small.stats()
    assert stats["preemptions"] > 0 and stats["recomputed_tokens"] > 0
    assert max(peak) <= 24 and stats["kv_blocks_used"] == 0
    for seq, ref in zip(seqs, reference):
        assert seq.output_ids == ref.output_ids and seq.finish_reason == FinishReason.LENGTH
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)


def test_decode_length_groups_keep_outputs_exact(tiny_models):
    """Splitting the decode batch by context length (to gather less padding: the torch path) changes no number."""
    model_dir = tiny_models("llama", **PARITY)
    prompts = prompts_of([3, 60, 7, 41, 1, 90, 15, 33], seed=6)
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.0 if i % 2 else 1.0, seed=i)
              for i in range(len(prompts))]
    one = make_core(model_dir, block_size=4, kernels="torch")
    one.runner.group_penalty_blocks = 10**9                 # never split
    split = make_core(model_dir, block_size=4, kernels="torch")
    split.runner.group_penalty_blocks = 0                   # split wherever widths differ
    ref, seqs = run(one, prompts, params), run(split, prompts, params)
    assert one.stats()["decode_attention_groups"] == one.stats()["steps"] - 1   # the first step only prefills
    assert split.stats()["decode_attention_groups"] > 2 * split.stats()["steps"]
    for seq, r in zip(seqs, ref):
        assert seq.output_ids == r.output_ids
        torch.testing.assert_close(torch.tensor(seq.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_split_by_width():
    assert split_by_width([], 5) == []
    assert split_by_width([9, 9, 9], 0) == [(0, 3)]
    assert split_by_width([20, 20, 2, 2, 2, 2], 4) == [(0, 2), (2, 6)]           # 40 + 8 + 4 < 120
    assert split_by_width([20, 20, 2, 2, 2, 2], 100) == [(0, 6)]
    assert split_by_width([40, 30, 20, 10], 0, max_depth=2) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_admission_respects_max_num_seqs(tiny_models):
    core = make_core(tiny_models("qwen2"), max_num_seqs=3)
    running = []
    seqs = run(core, prompts_of([5, 9, 2, 14, 7, 3, 11, 6]), SamplingParams(max_new_tokens=6, ignore_eos=True),
               on_step=lambda c: running.append(len(c.scheduler.running)))
    assert max(running) == 3
    assert all(s.num_generated == 6 for s in seqs)


def test_finish_reasons(tiny_models):
    model_dir = tiny_models("llama", **PARITY)
    core = make_core(model_dir)
    prompt = prompts_of([6], seed=3)[0]
    free = run(core, [prompt], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert free.finish_reason == FinishReason.LENGTH and free.num_generated == 12
    stop = free.output_ids[4]
    first = free.output_ids.index(stop)
    stopped = run(core, [prompt], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True,
                                                 stop_token_ids=(stop,)))[0]
    assert stopped.finish_reason == FinishReason.STOP and stopped.output_ids == free.output_ids[:first + 1]
    short = make_core(model_dir, max_model_len=10)
    ctx = run(short, [prompt], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert ctx.finish_reason == FinishReason.CONTEXT and ctx.output_ids == free.output_ids[:4]


def test_cache_capacity_caps_max_model_len(tiny_models):
    model_dir = tiny_models("qwen2")
    core = make_core(model_dir, num_blocks=4, block_size=4)
    assert core.max_model_len == 16
    with pytest.raises(ValueError, match="max_model_len=32 needs more KV than the cache holds"):
        make_core(model_dir, num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        make_core(model_dir, max_model_len=10**6)


def _check_pool(core: EngineCore) -> None:
    pool, sched = core.pool, core.scheduler
    refs = [0] * pool.num_blocks
    for seq in sched.running:
        for b in seq.blocks:
            refs[b] += 1
    assert refs == pool.ref                                         # every reference is a running sequence's
    free, cached = set(pool.free), set(pool.evictable)
    assert not free & cached and len(free) == len(pool.free)
    assert all(pool.ref[b] == 0 for b in free | cached)
    assert len(free) + len(cached) + sum(1 for r in pool.ref if r) == pool.num_blocks
    for h, b in pool.by_hash.items():
        assert pool.hash_of[b] == h


def test_random_workload_keeps_the_pool_consistent_and_outputs_exact(tiny_models):
    """Arrivals, shared prefixes, aborts, a small cache: invariants every step; survivors equal a plain run."""
    import random

    rng = random.Random(0)
    model_dir = tiny_models("llama", **PARITY)
    core = make_core(model_dir, num_blocks=28, block_size=4, max_num_seqs=6, max_num_batched_tokens=24,
                     watermark_blocks=0)
    base = prompts_of([30], seed=11)[0]
    pending = []
    for i in range(40):
        prompt = base[:rng.randint(1, 30)] + prompts_of([rng.randint(0, 12)], seed=100 + i)[0]
        sp = SamplingParams(max_new_tokens=rng.randint(1, 25), ignore_eos=True,
                            temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([-1, 7]), seed=i)
        pending.append((rng.randint(0, 40), prompt, sp, f"q{i}"))
    seqs, aborted = {}, set()
    with torch.no_grad():
        for step in range(2000):
            for at, prompt, sp, rid in pending:
                if at == step:
                    seqs[rid] = core.make_sequence(prompt, sp, rid)
                    core.add(seqs[rid])
            if step % 17 == 5 and core.requests:
                victim = rng.choice(sorted(core.requests))
                core.abort(victim)
                aborted.add(victim)
            if core.has_work():
                core.step()
            _check_pool(core)
            if step > 40 and not core.has_work():
                break
    assert len(seqs) == 40 and all(s.finish_reason is not None for s in seqs.values())
    assert core.stats()["kv_blocks_used"] == 0 and core.stats()["preemptions"] > 0
    assert core.stats()["prefix_hit_tokens"] > 0 and core.stats()["prefix_copied_tokens"] > 0
    survivors = [rid for rid in seqs if rid not in aborted]
    plain = make_core(model_dir, enable_prefix_caching=False)
    ref = run(plain, [seqs[r].tokens[:seqs[r].prompt_len] for r in survivors], [seqs[r].params for r in survivors])
    for rid, r in zip(survivors, ref):
        assert seqs[rid].output_ids == r.output_ids, rid
        torch.testing.assert_close(torch.tensor(seqs[rid].logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


def test_outputs_do_not_depend_on_what_the_engine_served_before_a_weight_update(tiny_models):
    """A resumed RL run's engine has a shorter history than the uninterrupted run's: after an
    invalidation (every weight update) the same requests must give bitwise the same tokens and
    logprobs. The physical block a request gets orders the prefix cache's candidates for a partial
    prefix, whose rows (computed in different batches) agree only to rounding."""
    import random

    def workload(seed):
        rng = random.Random(seed)
        base = prompts_of([30], seed=11)[0]
        prompts, params = [], []
        for i in range(24):
            prompt = base[:rng.randint(1, 30)] + prompts_of([rng.randint(0, 12)], seed=seed * 100 + i)[0]
            for k in range(3):                       # a group: samples of one prompt
                prompts.append(prompt)
                params.append(SamplingParams(max_new_tokens=rng.randint(1, 20), ignore_eos=True, temperature=0.8,
                                             seed=7 * i + k))
        return prompts, params

    model_dir = tiny_models("llama", **PARITY)
    shape = dict(num_blocks=28, block_size=4, max_num_seqs=6, max_num_batched_tokens=24, watermark_blocks=0)
    served = make_core(model_dir, **shape)
    for seed in (1, 2):
        run(served, *workload(seed))
        served.pool.invalidate()
    fresh = make_core(model_dir, **shape)
    a, b = run(served, *workload(3)), run(fresh, *workload(3))
    assert fresh.stats()["prefix_copied_tokens"] > 0 and fresh.stats()["preemptions"] > 0
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]            # bitwise
