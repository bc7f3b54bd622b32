"""The generation latency metrics (`gen/ttft_*`, `gen/itl_*`, `gen/batch_*`) against an independent computation
from the engine's own per-token timestamps."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridrl.backends.native import NativeEngineConfig
from hybridrl.backends.native.core import EngineCore
from hybridrl.controller.metrics import engine_metrics
from hybridrl.rollout.protocol import SamplingParams
from tests.backends.native.conftest import prompts_of

pytestmark = pytest.mark.timeout(60)
MAX_SEQS = 8


def run_wave(core: EngineCore, tag: str, lengths: list[int], budgets: list[int]) -> list:
    """Requests arriving over the first steps (so TTFTs differ), run to the end; returns their sequences."""
    seqs = []
    for i, (prompt, budget) in enumerate(zip(prompts_of(lengths, vocab=200, seed=len(tag)), budgets)):
        seq = core.make_sequence(prompt, SamplingParams(max_new_tokens=budget, ignore_eos=True), f"{tag}{i}")
        core.add(seq)
        seqs.append(seq)
        if i % 3 == 2:
            core.step()
    while core.has_work():
        core.step()
    return seqs


def expected(seqs: list) -> dict[str, float]:
    """From the timestamps alone. Prompts fit one step's budget, so every sequence a step computes gets a
    token in it, and the tokens of one step share its timestamp: a step's batch is a timestamp's count."""
    ttft = [s.token_times[0] - s.t_submit for s in seqs]
    itl = np.concatenate([np.diff(s.token_times) for s in seqs])
    batches = list(Counter(t for s in seqs for t in s.token_times).values())
    return {"gen/ttft_p50_s": np.percentile(ttft, 50), "gen/ttft_p90_s": np.percentile(ttft, 90),
            "gen/itl_p50_s": np.percentile(itl, 50), "gen/itl_p90_s": np.percentile(itl, 90),
            "gen/batch_size": np.mean(batches), "gen/batch_utilisation": np.mean(batches) / MAX_SEQS}


def test_latency_metrics_match_the_timestamps(tiny_models):
    cfg = NativeEngineConfig(kv_cache_mb=8, max_num_seqs=MAX_SEQS, max_num_batched_tokens=256,
                             enable_prefix_caching=False)
    core = EngineCore.from_pretrained(tiny_models("qwen2"), cfg, device=torch.device("cpu"))
    run = SimpleNamespace(counters={})
    for wave, n in (("a", 10), ("bb", 6)):           # the second read covers the second wave only
        seqs = run_wave(core, wave, [5 + 3 * i for i in range(n)], [3 + (i * 5) % 11 for i in range(n)])
        got = engine_metrics([{"engine": core.stats(), "agent": {}}], run)
        want = expected(seqs)
        assert set(want) <= set(got)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        assert got["gen/ttft_p90_s"] > got["gen/ttft_p50_s"] > 0 and got["gen/itl_p50_s"] > 0
        assert 1 < got["gen/batch_size"] <= MAX_SEQS
