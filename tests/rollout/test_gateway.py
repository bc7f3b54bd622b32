"""RolloutGateway over two real native engines: prefix affinity, spilling, backpressure, fan-out."""

from __future__ import annotations

import asyncio

import pytest
import torch

from hybridrl.backends.native import NativeEngine, NativeEngineConfig
from hybridrl.rollout import RolloutEngine, RolloutGateway, SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def engines(tiny_models):
    made = [NativeEngine.from_pretrained(tiny_models("qwen2"), NativeEngineConfig(kv_cache_mb=8)) for _ in range(2)]
    yield made
    for e in made:
        e.close()


def run(gateway, prompts, sampling, tag="r"):
    async def go():
        return await asyncio.gather(*[gateway.generate(p, sampling, f"{tag}{i}") for i, p in enumerate(prompts)])
    return asyncio.run(go())


def test_samples_of_a_prompt_meet_on_one_replica(engines):
    gateway = RolloutGateway(engines, max_imbalance=100)
    assert isinstance(gateway, RolloutEngine)
    a, b = list(range(10, 50)), list(range(100, 133))
    outs = run(gateway, [a] * 8 + [b] * 8, SamplingParams(max_new_tokens=4))
    assert len(outs) == 16 and all(len(o.token_ids) > 0 for o in outs)
    homes = {gateway.route(a), gateway.route(b)}
    stats = [e.stats() for e in engines]
    # each prompt was computed on one replica only, once (+ one token per extra sample)
    assert sum(s["prefill_tokens"] for s in stats) == len(a) + 7 + len(b) + 7
    assert sum(gateway.counters["routed"]) == 16 and gateway.counters["spilled"] == 0
    assert all(stats[i]["requests_finished"] > 0 for i in homes)


def test_overloaded_home_spills_and_inflight_is_bounded(engines):
    gateway = RolloutGateway(engines, max_inflight=3, max_imbalance=0)
    peak = []

    async def go():
        async def watch():
            while True:
                peak.append(sum(gateway._load))
                await asyncio.sleep(0)
        watcher = asyncio.create_task(watch())
        outs = await asyncio.gather(*[gateway.generate([5, 6, 7], SamplingParams(max_new_tokens=6), f"s{i}")
                                      for i in range(10)])
        watcher.cancel()
        return outs

    outs = asyncio.run(go())
    assert len(outs) == 10 and max(peak) == 3
    assert gateway.counters["spilled"] > 0 and min(gateway.counters["routed"]) > 0
    assert gateway.counters["waited_for_slot"] > 0


def test_weights_and_memory_calls_reach_every_replica(engines):
    gateway = RolloutGateway(engines)
    spec = engines[0].weight_spec()
    named = [(n, torch.zeros(shape, dtype=dtype)) for n, (shape, dtype) in spec.items()]
    asyncio.run(gateway.update_weights(named, 4))
    assert gateway.policy_version == 4 and all(e.policy_version == 4 for e in engines)
    asyncio.run(gateway.sleep())
    assert all(e.stats()["asleep"] for e in engines)
    asyncio.run(gateway.wake_up())
    out = run(gateway, [[3, 4]], SamplingParams(max_new_tokens=2))[0]
    assert out.policy_version == 4
    assert asyncio.run(gateway.abort("nobody")) is False
