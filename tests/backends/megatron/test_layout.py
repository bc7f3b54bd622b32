"""Parallel layouts: uneven pipeline stages with real ranks (3 layers on PP 2; a 28-layer, tiny
width model on PP 3) match transformers and a PP 1 step; impossible layouts are refused at
config load (exit 2, one line naming the key) before any process group starts; norm weights
follow params_dtype."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridrl.backends.megatron.config import layout_problem, pipeline_stage_layers
from tests.backends.megatron.conftest import INIT_STD, run_job

LR = 1e-4


@pytest.mark.parametrize("layers,pp,want", [(3, 2, [2, 1]), (28, 3, [10, 9, 9]), (28, 4, [7] * 4),
                                            (29, 5, [6, 6, 6, 6, 5]), (4, 4, [1] * 4)])
def test_stage_layers(layers, pp, want):
    assert pipeline_stage_layers(layers, pp) == want


@pytest.mark.parametrize("layers,pp,nproc", [(3, 2, 2), (28, 3, 3)])
def test_uneven_pipeline_matches_transformers_and_pp1(tiny_models, tmp_path, layers, pp, nproc):
    model = tiny_models("qwen2", layers=layers, hidden=32, intermediate=64, init_std=INIT_STD)
    run_job(nproc, "uneven", tmp_path, model, LR)
    ranks = json.loads((tmp_path / f"uneven_w{nproc}.json").read_text())
    assert [r["stage_layers"] for r in ranks] == pipeline_stage_layers(layers, pp)
    [out] = [r for r in ranks if "logprobs_vs_hf" in r]
    assert out["logprobs_vs_hf"] < 1e-4, out
    for r in ranks:
        assert r["bitwise_round_trip"], r
        assert abs(r[f"loss_pp{pp}"] - r["loss_pp1"]) < 1e-5, r
        assert r["weights_max_diff"] < 1e-5, r


def test_layout_problems_name_the_key():
    shape = dict(num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=64)
    assert layout_problem(tp=1, pp=3, world_size=3, **shape) is None
    assert layout_problem(tp=2, pp=1, world_size=4, **shape) is None
    assert layout_problem(tp=1, pp=4, world_size=4, **shape).startswith("train.pp=4: more pipeline stages")
    assert layout_problem(tp=4, pp=1, world_size=4, **shape).startswith("train.tp=4: does not divide the model's 2 KV")
    assert layout_problem(tp=3, pp=1, world_size=3, **shape).startswith("train.tp=3: does not divide the model's 4 att")
    assert layout_problem(tp=2, pp=1, world_size=3, **shape).startswith("train.tp=2 x train.pp=1 = 2 does not divide")


@pytest.mark.parametrize("override,key", [("train.pp=3", "train.pp=3"), ("train.tp=4", "train.tp=4"),
                                          ("train.tp=2", "train.tp=2 x train.pp=1")])
def test_train_refuses_an_impossible_layout_before_starting(tiny_models, tmp_path, override, key):
    """2 layers, 4 heads / 2 KV heads, 3 ranks: the real launch path (no --check) exits 2 with one
    line naming the key, and starts no torchrun."""
    model = tiny_models("qwen2")
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "train", f"model.path={model}",
                           f"run.dir={tmp_path / 'run'}", "run.job=rl", "distributed.nproc_per_node=3", override],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"hybridrl: {key}"), proc.stderr
    assert "launching" not in proc.stderr and "Traceback" not in proc.stderr


def test_score_refuses_pp_beyond_the_layers(tiny_models, tmp_path):
    model = tiny_models("qwen2")
    seqs = tmp_path / "in.jsonl"
    seqs.write_text('{"id": 0, "token_ids": [1, 2, 3]}\n')
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "score", "--model", str(model), "--pp", "3",
                           "--input", str(seqs), "--output", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "hybridrl score: --pp=3: more pipeline stages than the model's 2 layers (use --pp <= 2)"], proc.stderr


def test_norm_weights_follow_params_dtype_in_the_model_and_the_publication(qwen2_dir, tmp_path):
    """bf16 run (built on CPU at TP 2): the RMSNorm scales are bf16 like every other parameter, and
    what is published (iter_hf_tensors) has exactly the names, shapes and dtypes hf_spec() declares."""
    run_job(2, "norms", tmp_path, qwen2_dir)
    for rank in json.loads((tmp_path / "norms.json").read_text()):
        assert rank["num_norms"] == 2 * 2 + 1                       # 2 layers x (input, pre-MLP) + final
        assert rank["norm_dtypes"] == rank["param_dtypes"] == ["torch.bfloat16"], rank
        assert rank["published_dtypes"] == ["torch.bfloat16"] and rank["published_matches_spec"], rank
