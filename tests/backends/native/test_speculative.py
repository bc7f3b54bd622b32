"""Exact speculative decoding (prompt lookup): the same tokens and logprobs as without drafts, and the same
distribution (a chi-square test that a deliberately broken acceptance rule fails)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hybridrl.backends.native import NativeEngineConfig, speculative
from hybridrl.backends.native.core import EngineCore
from hybridrl.backends.native.speculative import PromptLookup, accepted_drafts
from hybridrl.config.fields import ConfigValueError
from hybridrl.rollout.protocol import SamplingParams
from tests.backends.native.conftest import PARITY, generate_all, hf_logprobs, needs_kernels

pytestmark = pytest.mark.timeout(120)

# peaked logits over a small vocabulary: the chi-square test's cells
SMALL = dict(vocab_size=16, vocab_multiple=16, init_std=0.4, tie_embeddings=False)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    lookup = PromptLookup(2, 3)
    assert lookup.propose([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]                # 3-gram [5, 6, 7]
    assert lookup.propose([5, 6, 7, 8, 9, 5, 6, 7, 1, 6, 7], 2) == [1, 6]          # the latest [6, 7]
    assert lookup.propose([5, 6, 7, 8, 9, 5, 6, 7, 1, 6, 7, 4, 4], 2) == []        # [7, 4, 4], [4, 4]: unseen
    assert lookup.propose([1, 2], 4) == []                                         # nothing earlier
    assert PromptLookup(1, 1).propose([3, 4, 3], 5) == [4, 3]                      # continuation runs to the end
    assert accepted_drafts([1, 2, 3], [1, 2]) == 2 and accepted_drafts([1, 9, 3], [1, 2]) == 1
    assert accepted_drafts([7, 2, 3], [1, 2]) == 0
    with pytest.raises(ConfigValueError, match="must be >= speculative_ngram_min"):
        NativeEngineConfig(speculative_tokens=4, speculative_ngram_min=3, speculative_ngram_max=2)


def repeating_prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 20, (5,), generator=g).tolist() * 4 for _ in range(n)]


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_outputs_and_logprobs_are_the_targets(kernels, tiny_models, make_engine, hf_model):
    """Greedy and seeded sampling (temperature, top-k, top-p): the same tokens as the engine without drafts,
    logprobs equal to a transformers forward; a follow-up turn served from the prefix cache the drafted run
    left behind (rolled-back rows must not be in it) still matches."""
    model_dir = tiny_models("qwen2", **PARITY)
    prompts = repeating_prompts(6)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=t, top_k=k, top_p=p, seed=i)
              for i, (t, k, p) in enumerate([(0.0, -1, 1.0), (0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, 5, 1.0),
                                             (0.8, -1, 0.9), (1.3, 4, 0.8)])]
    outs = {}
    for k in (0, 4):
        engine = make_engine(model_dir, kernels=kernels, block_size=4, speculative_tokens=k, speculative_ngram_min=1)
        first = generate_all(engine, prompts, params)
        follow = [p + o.token_ids + p[:3] for p, o in zip(prompts, first)]
        outs[k] = (first, generate_all(engine, follow, params, tag="f"), follow, engine.stats())
    stats = outs[4][3]
    assert stats["spec_accepted_tokens"] > 20 and stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
    assert stats["prefix_hit_tokens"] > 0
    model = hf_model(model_dir)
    for turn in (0, 1):
        for i, (ref, got) in enumerate(zip(outs[0][turn], outs[4][turn])):
            assert got.token_ids == ref.token_ids, (turn, i)
            prompt = (prompts if turn == 0 else outs[4][2])[i]
            target = hf_logprobs(model, prompt, got.token_ids, params[i].temperature or 1.0)
            torch.testing.assert_close(torch.tensor(got.logprobs), target, atol=2e-5, rtol=0)


SAMPLING = dict(ignore_eos=True, temperature=0.6, top_k=3, top_p=0.95)      # the transform the drafts must respect


def sample_pairs(model_dir, *, drafts: int, seeds: range) -> Counter:
    """(output token 1, output token 2) of one prompt over many seeds (drafting starts at token 1). The model
    is made a bigram model (attention and MLP outputs zeroed, an untied head): its sampled chains revisit
    tokens, so the drafts copied from the context are often its own choice, and often not."""
    cfg = NativeEngineConfig(kv_cache_mb=8, block_size=4, max_num_seqs=256, max_num_batched_tokens=1024,
                             speculative_tokens=drafts, speculative_ngram_min=1, enable_prefix_caching=False)
    core = EngineCore.from_pretrained(model_dir, cfg, device=torch.device("cpu"))
    for name, tensor in core.views.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    context = core.make_sequence([5, 9, 4], SamplingParams(max_new_tokens=30, seed=123, **SAMPLING), "context")
    core.add(context)
    run_to_end(core)
    seqs = []
    for seed in seeds:
        seq = core.make_sequence(context.tokens, SamplingParams(max_new_tokens=4, seed=seed, **SAMPLING), f"s{seed}")
        core.add(seq)
        seqs.append(seq)
    run_to_end(core)
    if drafts:
        assert core.counters["spec_accepted_tokens"] > len(seeds) // 10       # the drafts are in play
    return Counter(tuple(s.output_ids[1:3]) for s in seqs)


def run_to_end(core) -> None:
    while core.has_work():
        core.step()


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of the two-sample chi-square test of homogeneity (cells with < 10 expected pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    cells, rest = [], [0, 0]
    for key in set(a) | set(b):
        row = [a.get(key, 0), b.get(key, 0)]
        if sum(row) * min(na, nb) / (na + nb) < 10:
            rest = [rest[0] + row[0], rest[1] + row[1]]
        else:
            cells.append(row)
    if sum(rest):
        cells.append(rest)
    stat = 0.0
    for x, y in cells:
        total = x + y
        for obs, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (obs - expected) ** 2 / expected
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module")
def pair_counts(tiny_models):
    needs_kernels("c")
    model_dir = tiny_models("qwen2", **SMALL)
    return model_dir, sample_pairs(model_dir, drafts=0, seeds=range(0, 400))


def test_the_distribution_with_drafts_is_the_targets(pair_counts):
    model_dir, plain = pair_counts
    drafted = sample_pairs(model_dir, drafts=3, seeds=range(10_000, 10_400))      # other seeds: independent
    assert len(plain) > 5                                    # a distribution, not a point mass
    assert chi_square_p(plain, drafted) > 1e-3


def test_a_broken_acceptance_rule_is_caught(pair_counts, monkeypatch):
    model_dir, plain = pair_counts
    # the classic mistake: trust the first draft without testing it against the target
    monkeypatch.setattr(speculative, "accepted_drafts",
                        lambda target, drafts: max(1, accepted_drafts(target, drafts)))
    drafted = sample_pairs(model_dir, drafts=3, seeds=range(10_000, 10_400))
    assert chi_square_p(plain, drafted) < 1e-6
