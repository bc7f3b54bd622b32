"""Megatron model vs transformers, real ranks over gloo: logits, logprobs, entropy at TP=1, TP=2,
PP=2 for Qwen2 (tied, qkv bias) and Llama (untied), on a right-padded batch of mixed lengths, with
our SDPA core attention (and once with Megatron's own); and HF -> Megatron -> HF bitwise through
`iter_hf_tensors` (gathered over TP and PP)."""

from __future__ import annotations

import json

import pytest

from tests.backends.megatron.conftest import run_job

LAYOUTS = ("tp1", "tp2", "pp2", "tp2-megatron-attention")
FAMILIES = ("qwen2", "llama")


@pytest.fixture(scope="module")
def parity(tmp_path_factory, qwen2_dir, llama_dir):
    out = tmp_path_factory.mktemp("parity")
    run_job(2, "parity", out, qwen2_dir, llama_dir)
    return json.loads((out / "parity.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_logprobs_entropy_match_transformers(parity, family, layout):
    ranks = parity[family][layout]
    outputs = [r for r in ranks if r["is_output_rank"]]
    # one output rank per data-parallel group: tp1 -> dp=2 (both ranks); tp2/pp2 -> one
    assert len(outputs) == (2 if layout == "tp1" else 1)
    for r in outputs:
        assert r["logits_max_abs"] > 1.0                       # not flat: mistakes would show
        assert r["logits_max_abs_diff"] < 1e-4, r
        assert r["logprobs_max_abs_diff"] < 1e-4, r
        assert r["entropy_max_abs_diff"] < 1e-4, r
        assert r["padded_positions_zero"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_round_trip_is_bitwise_on_every_rank(parity, family, layout):
    for r in parity[family][layout]:
        assert r["same_names"] and r["names_sorted"], r
        assert r["bitwise_equal"], r
        assert r["num_parameters_matches_hf"], r


LLAMA3_ROPE = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
               ("original_max_position_embeddings", 16))


def test_rope_scaling_is_the_one_transformers_and_the_native_engine_apply(tiny_models, tmp_path):
    """Both engines read RoPE scaling through one parser: Megatron matches transformers on a
    llama3-scaled model, whose logits the scaling visibly changes at these lengths."""
    import torch

    from tests.backends.megatron.conftest import INIT_STD
    from tests.backends.megatron.jobs import _hf_model
    from tests.backends.megatron.reference import hf_logits, sequence_batch

    scaled = tiny_models("llama", init_std=INIT_STD, rope_scaling=LLAMA3_ROPE)
    plain = tiny_models("llama", init_std=INIT_STD)
    batch = sequence_batch(3, vocab=_hf_model(plain).config.vocab_size, seed=1)
    assert float((hf_logits(_hf_model(scaled), batch) - hf_logits(_hf_model(plain), batch)).abs().max()) > 0.05
    run_job(1, "parity", tmp_path, scaled)
    [rank] = json.loads((tmp_path / "parity.json").read_text())["llama"]["tp1"]
    assert rank["logits_max_abs_diff"] < 1e-4 and rank["logprobs_max_abs_diff"] < 1e-4, rank
    assert torch.isfinite(torch.tensor(rank["logits_max_abs"]))
