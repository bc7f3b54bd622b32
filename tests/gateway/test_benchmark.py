"""benchmarks/gateway.py overhead runs end to end with the instant engine and writes what its readers use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch import ROOT, env_with_repo

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(300)


def test_overhead_with_the_instant_engine_measures_the_path(tmp_path, base_tokenizer_dir):
    out = tmp_path / "gw.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gateway.py", "overhead", "--engine", "instant", "--agents", "1", "4",
         "--repeats", "1", "--turns", "2", "--min-requests", "2", "--modes", "direct", "gateway_inline",
         "--client", "http", "--model", str(base_tokenizer_dir), "--json", str(out)],
        cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["engine"] == "instant"
    for agents in ("1", "4"):
        row = result["by_agents"][agents]
        # the same work in both modes: the same questions, the same answer from the engine
        assert row["tokens_per_request"]["direct"] == row["tokens_per_request"]["gateway_inline"] > 0
        assert all(row["cpu_ms_per_request"][m] > 0 for m in ("direct", "gateway_inline"))
        # times are measured, not compared: which mode is faster on a loaded machine is the benchmark's
        # figure (docs/benchmarks.md), never a test's verdict
        assert all(row["median_ms"][m] > 0 for m in ("direct", "gateway_inline"))
        assert "gateway_inline" in row["added_cpu_ms"]
