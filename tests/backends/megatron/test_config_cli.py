"""MegatronConfig validation, the light import contract, the CPU compat module, and `hybridrl score`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hybridrl.algo.aggregation import AGGREGATIONS as ALGO_AGGREGATIONS
from hybridrl.backends.megatron.config import AGGREGATIONS, MegatronConfig
from hybridrl.config import ConfigError, load_config
from tests.backends.megatron.reference import hf_logits, sequence_batch, token_logprobs
from tests.launch import ROOT, env_with_repo


def test_aggregation_modes_match_the_algo_module():
    assert AGGREGATIONS == ALGO_AGGREGATIONS


@pytest.mark.parametrize("override,key", [
    ("train.tp=0", "train.tp"),
    ("train.loss_aggregation=mean", "train.loss_aggregation"),
    ("train.lr_schedule=cosine", "train.lr_decay_steps"),          # cosine needs a decay length
    ("train.min_lr=1", "train.min_lr"),
    ("train.dtype=fp8", "train.dtype"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        load_config(None, [override])


def test_dp_size():
    assert MegatronConfig(tp=2, pp=2).dp_size(8) == 2
    with pytest.raises(ValueError, match="not divisible by tp\\*pp"):
        MegatronConfig(tp=2).dp_size(3)


def test_config_and_cli_import_neither_torch_nor_megatron():
    code = ("import sys, hybridrl.backends.megatron, hybridrl.backends.megatron.config, hybridrl.cli as c; "
            "c.build_parser(); print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_repo(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_cpu_compat_maps_cuda_literals_only_inside_the_scope():
    code = """
import torch
from hybridrl.backends.megatron import cpu_compat
cpu_compat.activate()
cpu = torch.device("cpu")
with cpu_compat.device_scope(cpu):
    a = torch.zeros(2, device="cuda")
    b = torch.tensor([1.0], device=torch.cuda.current_device())
    c = torch.ones(1).cuda()
    t = torch.ones(1).type()
torch.cuda.synchronize()
state = torch.cuda.get_rng_state()
try:
    torch.zeros(1, device="cuda")
    outside = "allocated"
except Exception:
    outside = "raised"
print(a.device, b.device, c.device, t, outside, torch.equal(state, torch.get_rng_state()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_repo(), cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cpu", "cpu", "cpu", "torch.cuda.FloatTensor", "raised", "True"]


def _cli(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "hybridrl", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env_with_repo({"OMP_NUM_THREADS": "1"}))


def test_score_tp2_matches_transformers(tmp_path, llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    batch = sequence_batch(5, vocab=model.config.vocab_size, seed=11)
    lengths = batch["attention_mask"].sum(1).tolist()
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text("".join(json.dumps({"id": f"s{i}", "token_ids": batch["input_ids"][i, :n].tolist()}) + "\n"
                            for i, n in enumerate(lengths)))
    out = tmp_path / "out.jsonl"
    proc = _cli("score", "--model", llama_dir, "--backend", "megatron", "--tp", 2, "--pp", 1, "--input", seqs,
                "--output", out, "--batch-size", 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref, _ = token_logprobs(hf_logits(model, batch), batch["input_ids"], batch["attention_mask"])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [f"s{i}" for i in range(5)]                # input order kept
    for i, (rec, n) in enumerate(zip(lines, lengths)):
        assert len(rec["logprobs"]) == n and rec["logprobs"][0] is None
        assert max(abs(a - b) for a, b in zip(rec["logprobs"][1:], ref[i, 1:n].tolist())) < 1e-4


def test_score_rejects_bad_input_before_starting_ranks(tmp_path, llama_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "token_ids": []}\n')
    proc = _cli("score", "--model", llama_dir, "--input", bad, "--output", tmp_path / "o.jsonl", timeout=60)
    assert proc.returncode == 2 and "bad.jsonl:1" in proc.stderr and "torch.distributed" not in proc.stderr
