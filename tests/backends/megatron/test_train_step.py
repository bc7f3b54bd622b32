"""train_step with real ranks: one global batch (7 sequences + 1 dispatcher padding row) gives the
same loss and the same updated weights under (TP1,DP1), (TP2,DP1), (TP1,DP2), (PP2) and with 1
or 4 micro-batches (and with activation recomputation), for every loss aggregation; and the same as plain transformers + torch AdamW.
Also: metrics reduced over the global batch, and offload/reload leaving training unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.algo.aggregation import AGGREGATIONS
from tests.backends.megatron.conftest import run_job
from tests.backends.megatron.reference import assert_same_weights, hf_train_step, sequence_batch

# Adam turns a gradient that is exactly 0 in exact arithmetic (the key bias: softmax ignores a
# shift shared by all keys) into a step of up to ~lr * O(1) driven by float noise of ~1e-8; at lr
# 1e-3 two summation orders then differ by ~2e-5 on those few elements. At 1e-4 (still well
# above RL learning rates) everything else is compared at the 1e-5 bound; the key biases by
# Adam's per-step bound (reference.assert_same_weights).
LR = 1e-4
TOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, qwen2_dir):
    out = tmp_path_factory.mktemp("train")
    run_job(1, "train", out, qwen2_dir, LR)
    run_job(2, "train", out, qwen2_dir, LR)
    records = json.loads((out / "train_w1.json").read_text()) + json.loads((out / "train_w2.json").read_text())
    by_key = {r["key"]: r for r in records}
    return out, by_key


def _weights(out, key):
    return torch.load(out / f"{key}.pt")


def _variants(by_key, mode):
    return {k: r for k, r in by_key.items() if r.get("mode") == mode}


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_layouts_and_micro_batches_agree(runs, mode):
    out, by_key = runs
    variants = _variants(by_key, mode)
    base_key = f"w1_tp1_pp1_dp1_mb1_{mode}"
    # see jobs._train_variants: token-mean under 4 layouts x {1, 4} micro-batches + activation
    # recomputation, the other modes in 3 runs
    assert base_key in variants and len(variants) == (9 if mode == "token-mean" else 3)
    base, base_w = variants[base_key], _weights(out, base_key)
    for key, r in variants.items():
        assert abs(r["first"]["loss"] - base["first"]["loss"]) < TOL, (key, r["first"], base["first"])
        assert abs(r["second"]["loss"] - base["second"]["loss"]) < TOL, (key, r["second"], base["second"])
        assert abs(r["first"]["grad_norm"] - base["first"]["grad_norm"]) < TOL * base["first"]["grad_norm"], key
        assert_same_weights(_weights(out, key), base_w, key, lr=LR, steps=1, tol=TOL)   # one step


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_matches_transformers_and_torch_adamw(runs, qwen2_dir, mode):
    from transformers import AutoModelForCausalLM

    out, by_key = runs
    key = f"w1_tp1_pp1_dp1_mb1_{mode}"
    model = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32)
    batch = sequence_batch(7, vocab=model.config.vocab_size, seed=3).pad_to(8, zero=["loss_mask"])
    loss, state = hf_train_step(model, batch, lr=LR, weight_decay=0.1, clip_grad=1.0, mode=mode, with_entropy=True)
    assert abs(by_key[key]["first"]["loss"] - loss) < TOL
    engine_w = _weights(out, key)
    assert_same_weights(engine_w, {n: state[n] for n in engine_w}, mode, lr=LR, steps=1, tol=TOL)


def test_metrics_are_global_token_means(runs, qwen2_dir):
    from transformers import AutoConfig

    _, by_key = runs
    vocab = AutoConfig.from_pretrained(qwen2_dir).vocab_size
    batch = sequence_batch(7, vocab=vocab, seed=3)
    mask = batch["loss_mask"]
    want_tokens = float(mask.sum())
    want_adv = float((batch["advantages"] * mask).sum() / mask.sum())
    for key in ("w1_tp1_pp1_dp1_mb1_token-mean", "w2_tp1_pp1_dp2_mb4_token-mean", "w2_tp1_pp2_dp1_mb4_token-mean"):
        first = by_key[key]["first"]
        assert first["num_tokens"] == want_tokens and first["num_sequences"] == 7.0   # padding row not counted
        assert abs(first["adv"] - want_adv) < 1e-6, key
        assert first["logprob"] < 0 and first["lr"] == pytest.approx(LR)


def test_offload_reload_keeps_training_identical(runs):
    _, by_key = runs
    r = by_key["offload"]
    assert r["offloaded"] == r["plain"]
    # on CPU only the gradient buffers can be released; optimizer state and params stay in host memory
    assert r["offload"] == r["reload"] == r["grad_bytes"] > 0
    assert r["offload_params"] == r["reload_params"] == 0
    # ... but optimizer state can be spilled to a file: nothing of it is held until reload
    assert r["spill"] == r["unspill"] == r["optimizer_state_bytes"] > 0
    assert r["held_while_spilled"] == 0


def test_frozen_reference_shares_the_parallel_state_and_stays_put(runs):
    _, by_key = runs
    r = by_key["actor_and_reference"]
    assert r["is_output_rank"] and r["ref_equals_initial_actor"] and r["actor_moved"] > 0
    assert "frozen" in r["ref_train_error"]
