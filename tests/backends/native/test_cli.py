"""`hybridrl generate`: JSONL in, JSONL out, through the real command-line entry point."""

from __future__ import annotations

import json

import pytest

from hybridrl.cli import main
from tests.backends.native.conftest import PARITY, hf_logprobs

pytestmark = pytest.mark.timeout(120)


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_generate_writes_samples_with_logprobs(tmp_path, tiny_models, hf_model):
    model_dir = tiny_models("llama", **PARITY)
    prompts = [{"id": "a", "token_ids": [5, 6, 7, 8]}, {"id": 7, "token_ids": [40, 41]}]
    write_prompts(tmp_path / "in.jsonl", prompts)
    args = ["generate", "--model", str(model_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "out.jsonl"), "--temperature", "0.7", "--top-p", "0.9", "--seed", "3",
            "--max-new-tokens", "6", "--n", "3", "rollout.native.kv_cache_mb=8", "rollout.native.block_size=4"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in rows] == [("a", 0), ("a", 1), ("a", 2), (7, 0), (7, 1), (7, 2)]
    model = hf_model(model_dir)
    for r in rows:
        assert set(r) >= {"id", "sample", "token_ids", "logprobs", "finish_reason"}
        assert r["finish_reason"] in ("length", "stop") and 0 < len(r["token_ids"]) <= 6
        prompt = next(p["token_ids"] for p in prompts if p["id"] == r["id"])
        ref = hf_logprobs(model, prompt, r["token_ids"], 0.7)
        assert max(abs(a - b) for a, b in zip(r["logprobs"], ref.tolist())) < 1e-4
    assert main(args) == 0                                   # same seed, same samples
    assert [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()] == rows


def test_generate_greedy_and_bad_input(tmp_path, tiny_models, capsys):
    model_dir = tiny_models("qwen2")
    write_prompts(tmp_path / "in.jsonl", [{"id": 1, "token_ids": [3, 4]}])
    base = ["generate", "--model", str(model_dir), "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "3"]
    assert main(base + ["--input", str(tmp_path / "in.jsonl"), "--greedy", "--n", "2", "rollout.native.kv_cache_mb=8"]) == 0
    a, b = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert a["token_ids"] == b["token_ids"]
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "token_ids": [3]}\n{"token_ids": [4]}\n')
    assert main(base + ["--input", str(tmp_path / "bad.jsonl"), "rollout.native.kv_cache_mb=8"]) == 2
    assert 'bad.jsonl:2: expected an object with "id" and one of "token_ids"' in capsys.readouterr().err
    assert main(base + ["--input", str(tmp_path / "in.jsonl"), "rollout.native.kv_cache_mb=8", "rollout.native.block_sise=4"]) == 2
    assert "did you mean 'block_size'" in capsys.readouterr().err
