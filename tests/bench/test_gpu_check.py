"""The GPU check kit's CPU run, end to end (benchmarks/gpu_check.py --device cpu): the same script a
GPU user runs, on a tiny model, one cycle. Its hybrid run is `hybridrl bench mode-switch`, whose
JSON is checked here too."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.launch import ROOT, env_with_repo


def test_gpu_check_cpu_run(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--out", str(tmp_path)],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["ok"] and r["native_vs_transformers"]["greedy_equal"] == "4/4"
    assert r["native_vs_transformers"]["logprob_max_abs"] < 1e-4
    assert r["native_vs_transformers"]["policy_versions"] == [1]            # served after the cycle's publication
    assert r["megatron_vs_transformers"]["logprob_max_abs"] < 1e-4
    cycle = r["hybrid_cycle"]
    assert cycle["published_cycles"] == "1/1" and cycle["parity_max_abs"] < 1e-4
    bench = cycle["bench"]
    assert bench["verify"] == "post_copy" and bench["cycles"] == 1
    for phase in ("offload", "publish", "wake", "sleep", "reload"):
        assert set(bench["phases"][phase]) == {"median_s", "bytes", "peak_mem_bytes"}
    moved = bench["bytes_must_move"]
    assert bench["phases"]["publish"]["bytes"] == moved["weights_into_engine"] > 0
    assert bench["phases"]["offload"]["bytes"] == moved["gradient_buffers_restored"] > 0
    assert bench["copy_floor_s"] > 0 and bench["ratio_to_floor"] == bench["switch_s"] / bench["copy_floor_s"]
    assert bench["first_touch_write_bytes_per_s"] > 0
    assert "mode switch of a" in proc.stdout
