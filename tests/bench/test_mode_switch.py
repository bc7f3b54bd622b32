"""`hybridrl bench mode-switch` runs real cycles and writes the JSON the issue specifies."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.launch import ROOT, env_with_repo


def test_mode_switch_bench_json(tmp_path, tiny_models):
    out = tmp_path / "ms.json"
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "bench", "mode-switch", "--model", str(tiny_models("qwen2")),
                           "--cycles", "2", "--kv-cache-mb", "4", "--spill-optimizer", "--json", str(out)],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["model_params"] > 0 and r["cycles"] == 2
    for phase in ("offload", "publish", "wake", "sleep", "reload"):
        assert set(r["phases"][phase]) == {"median_s", "bytes", "peak_mem_bytes"}
    assert r["phases"]["publish"]["bytes"] == r["bytes_must_move"]["weights_into_engine"] > 0
    assert r["bytes_must_move"]["optimizer_out_and_back"] > 0           # spilled and read back
    moved = r["bytes_must_move"]
    # offload moved the gradient buffers (freed) and the optimizer state (spilled to a file)
    assert moved["gradient_buffers_restored"] > 0
    assert r["phases"]["offload"]["bytes"] == moved["gradient_buffers_restored"] + moved["optimizer_out_and_back"] // 2
    assert r["copy_floor_s"] > 0 and r["ratio_to_floor"] == r["switch_s"] / r["copy_floor_s"]
    assert r["parity_max_abs"] < 1e-4
    assert "mode switch of a" in proc.stdout
