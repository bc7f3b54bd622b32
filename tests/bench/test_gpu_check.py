"""The GPU check kit's CPU run, end to end, as `make gpu-check GPU_CHECK_ARGS="--device cpu"` runs it:
through benchmarks/gpu_env.py with no package index reachable (PIP_NO_INDEX, no pip configuration,
an empty wheelhouse: everything is already in this venv), then benchmarks/gpu_check.py on a tiny
model, one cycle. Its hybrid run is `hybridrl bench mode-switch`, whose JSON is checked here too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import ROOT, env_with_repo

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_env  # noqa: E402

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": ""}


def test_gpu_check_cpu_run_offline(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    proc = subprocess.run([sys.executable, "benchmarks/gpu_env.py", "check", "--wheelhouse", str(wheelhouse), "--venv",
                           sys.prefix, "--", "--device", "cpu", "--out", str(tmp_path)], cwd=ROOT,
                          env=env_with_repo(OFFLINE), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "installed from the wheelhouse: nothing (everything was there)" in proc.stdout
    r = json.loads((tmp_path / "gpu_check.json").read_text())
    assert r["environment"]["how"].startswith(f"reused the venv {sys.prefix}") and r["environment"]["installed"] == []
    assert r["ok"] and r["native_vs_transformers"]["greedy_equal"] == "4/4"
    assert r["native_vs_transformers"]["logprob_max_abs"] < 1e-4
    assert r["native_vs_transformers"]["policy_versions"] == [1]            # served after the cycle's publication
    assert r["megatron_vs_transformers"]["logprob_max_abs"] < 1e-4
    cycle = r["hybrid_cycle"]
    assert cycle["published_cycles"] == "1/1" and cycle["parity_max_abs"] < 1e-4
    assert cycle["parity_tolerance"] == 1e-3                                 # float32 on both sides
    bench = cycle["bench"]
    assert bench["verify"] == "post_copy" and bench["cycles"] == 1
    for phase in ("offload", "publish", "wake", "sleep", "reload"):
        assert set(bench["phases"][phase]) == {"median_s", "bytes", "peak_mem_bytes"}
    moved = bench["bytes_must_move"]
    assert bench["phases"]["publish"]["bytes"] == moved["weights_into_engine"] > 0
    # a CPU device without hybrid.spill_optimizer keeps the optimizer state and the gradient buffers in place
    assert bench["phases"]["offload"]["bytes"] == moved["gradient_buffers_restored"] == 0
    assert moved["optimizer_out_and_back"] == 0
    assert bench["copy_floor_s"] > 0 and bench["ratio_to_floor"] == bench["switch_s"] / bench["copy_floor_s"]
    assert bench["first_touch_write_bytes_per_s"] > 0
    assert "mode switch of a" in proc.stdout


def test_a_requirement_missing_from_the_wheelhouse_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_env, "requirements", lambda: ["hybridrl-no-such-package==1.0"])
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")       # would be refused if it were asked
    with pytest.raises(SystemExit) as info:
        gpu_env.prepare(Path(sys.prefix), tmp_path)
    message = str(info.value)
    assert "from the wheelhouse" in message and "no index is used" in message and "make gpu-wheels" in message
    assert "hybridrl-no-such-package" in message


def test_the_wheelhouse_holds_what_hybridrl_needs_without_torch():
    reqs = gpu_env.requirements()
    assert "torch>=2.4" in reqs and any(r.startswith("megatron-core") for r in reqs) and "pytest>=8" in reqs
    pins = gpu_env.closure([r for r in reqs if not r.startswith("torch")], python_version="3.12", exclude={"torch"})
    assert {"megatron-core", "transformers", "tokenizers", "huggingface-hub", "numpy", "pytest"} <= set(pins)
    assert not {"torch", "sympy", "networkx"} & set(pins)                    # torch's own dependencies stay out


def test_a_target_platform_takes_the_older_manylinux_tags_too():
    tags = gpu_env.platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-3:] == ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                               "manylinux1_x86_64"]
    assert "manylinux_2_17_x86_64" in tags and "manylinux_2_29_x86_64" not in tags
    assert gpu_env.platforms("macosx_14_0_arm64") == ["macosx_14_0_arm64"]
