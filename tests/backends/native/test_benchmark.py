"""benchmarks/generation.py runs end to end and writes the keys its readers use (tiny settings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch import ROOT, env_with_repo

pytestmark = pytest.mark.timeout(300)


def test_generation_benchmark_writes_its_json(tmp_path):
    out = tmp_path / "gen.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/generation.py", "--json", str(out), "--sizes", "tiny", "--batch", "4",
         "--repeats", "2", "--prompt-len", "4:12", "--output-len", "4:8", "--kv-cache-mb", "8", "--threads", "1",
         "--long-prompt-len", "80:120", "--long-output-len", "4:6", "--long-batch", "3",
         "--max-num-batched-tokens", "64", "--torch-peer"],
        cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for key in ("engine_tokens_per_s", "hf_tokens_per_s", "ratio", "params", "workload", "sizes"):
        assert key in result
    size = result["sizes"][0]
    assert size["size"] == "tiny" and size["params"] > 0 and len(size["runs"]) == 2
    assert result["engine_tokens_per_s"] > 0 and result["hf_tokens_per_s"] > 0
    assert all(r["engine_tokens"] > 0 and r["hf_tokens"] > 0 for r in size["runs"])
    assert size["engine_kernels"] in ("c", "torch") and size["ratio_native_engine_torch"] > 0
    assert all(r["engine_torch_tokens"] > 0 for r in size["runs"])
    # the roofline: each repeat's engine steps and seconds against the weights' bytes at the copy bandwidth
    roof = size["roofline"]
    assert roof["weight_bytes"] == 4 * size["params"] and roof["copy_gb_s"] > 0
    for r in size["runs"]:
        assert 0 < r["engine_steps"] and r["step_s"] == pytest.approx(r["engine_s"] / r["engine_steps"], rel=0.02)
        assert r["x_roofline"] == pytest.approx(r["step_s"] / r["floor_step_s"], rel=0.05)
    long = result["long_prompt"]
    assert long["shape"]["name"] == "long_prompt" and long["ratio"] > 0
    assert long["engine_steps"] > 0 and all(r["engine_tokens"] > 0 for r in long["runs"])
