"""The sampler's pure functions against transformers' warpers and against the distribution itself."""

from __future__ import annotations

import pytest
import torch

from hybridrl.backends.native.sampler import SamplingBatch, request_seed, sample, top_k_top_p_keep, uniform

pytestmark = pytest.mark.timeout(120)


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2.0


def test_greedy_is_argmax_with_ties_to_the_lowest_id_and_logprob_at_temperature_one():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0]])
    batch = SamplingBatch.build([(0.0, -1, 1.0, 1, 0), (0.0, 5, 0.5, 2, 0)], 4, torch.device("cpu"))
    tokens, logprobs = sample(logits, batch)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.6), (20, 0.9), (1, 0.3), (-1, 0.999)])
def test_filter_keeps_what_transformers_warpers_keep(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scaled = _logits(16, 300, seed=top_k + 100)
    ref = scaled.clone()
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    keep = top_k_top_p_keep(scaled, torch.full((16,), top_k if top_k > 0 else 300), torch.full((16,), top_p))
    assert torch.equal(keep, ref > float("-inf"))


def test_per_row_filters_in_one_batch():
    scaled = _logits(3, 50, seed=1)
    keep = top_k_top_p_keep(scaled, torch.tensor([3, 50, 50]), torch.tensor([1.0, 0.5, 1.0]))
    assert keep[0].sum() == 3 and keep[2].all()
    probs = scaled[1].softmax(-1).sort(descending=True).values
    expected = int((probs.cumsum(0) - probs < 0.5).sum())       # smallest prefix reaching 0.5
    assert keep[1].sum() == expected


def test_draws_follow_the_filtered_distribution():
    """Many seeds over the same logits: empirical frequencies match softmax(logits / T) after top-k."""
    vocab, rows = 12, 20000
    base = _logits(1, vocab, seed=3)
    logits = base.expand(rows, vocab).contiguous()
    batch = SamplingBatch.build([(0.8, 6, 1.0, seed, 0) for seed in range(rows)], vocab, torch.device("cpu"))
    tokens, logprobs = sample(logits, batch)
    scaled = base[0] / 0.8
    keep = scaled >= scaled.topk(6).values[-1]
    target = torch.where(keep, scaled, torch.tensor(float("-inf"))).softmax(-1)
    freq = torch.bincount(tokens, minlength=vocab).double() / rows
    assert freq[~keep].sum() == 0
    assert (freq - target.double()).abs().max() < 0.015          # ~4 standard errors at n=20000
    # logprob is the unfiltered log_softmax(logits / T) of the drawn token
    torch.testing.assert_close(logprobs, torch.log_softmax(scaled, -1)[tokens])


def test_draw_is_a_function_of_seed_and_index_only():
    logits = _logits(4, 64, seed=5)
    rows = [(1.0, -1, 1.0, 42, 3), (0.0, -1, 1.0, 0, 0), (1.0, -1, 1.0, 42, 3), (0.7, 10, 0.9, 7, 0)]
    tokens, _ = sample(logits[[0, 1, 0, 3]], SamplingBatch.build(rows, 64, torch.device("cpu")))
    alone, _ = sample(logits[[0]], SamplingBatch.build(rows[:1], 64, torch.device("cpu")))
    assert tokens[0] == tokens[2] == alone[0]
    assert tokens[1] == logits[1].argmax()


def test_uniform_and_request_seed():
    values = [uniform(9, i) for i in range(2000)]
    assert all(0.0 < v < 1.0 for v in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03
    assert uniform(9, 0) == uniform(9, 0) != uniform(10, 0)
    assert request_seed(0, "a") == request_seed(0, "a") != request_seed(1, "a")
    assert request_seed(0, "a") != request_seed(0, "b")
