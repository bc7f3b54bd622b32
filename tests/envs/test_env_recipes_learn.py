"""The shipped recipes of the data task and of reasoning-gym learn (slow): from the demo's base model,
their SFT then 20 GRPO steps gain >= 20 points of greedy validation accuracy, run as docs/tasks.md says
(from the repository root, each stage a real 2-rank run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from hybridrl.demo import BASE_MODEL_ARGS
from hybridrl.telemetry.metrics import read_metrics
from tests.launch import ROOT, env_with_repo


def hybridrl(*argv: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", *argv], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", ["data", "rg_chain_sum"])
def test_the_recipe_gains_20_validation_points_in_20_steps(name, tmp_path):
    if name.startswith("rg_"):
        pytest.importorskip("reasoning_gym", reason="pip install -e .[reasoning-gym]")
    base, sft, grpo = tmp_path / "base", tmp_path / "sft", tmp_path / "grpo"
    seconds = {}
    for stage, argv in (("base", ["assets", "tiny-model", *BASE_MODEL_ARGS, "--out", str(base)]),
                        ("sft", ["sft", f"recipes/{name}_sft_cpu.yaml", f"model.path={base}", f"run.dir={sft}"]),
                        ("grpo", ["train", f"recipes/{name}_grpo_cpu.yaml", f"model.path={sft / 'hf'}",
                                  f"run.dir={grpo}"])):
        started = time.perf_counter()
        proc = hybridrl(*argv)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        seconds[stage] = round(time.perf_counter() - started, 1)
    vals = [(r["step"], r["val/accuracy"]) for r in read_metrics(grpo) if r.get("val/accuracy") is not None]
    print(json.dumps({"recipe": name, "validation": vals, "seconds": seconds}))
    assert vals[0][0] == 0 and vals[-1][0] <= 20
    assert 100 * (vals[-1][1] - vals[0][1]) >= 20, vals


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_verifiers_recipe_gains_20_validation_points_from_the_demos_sft_model(tmp_path):
    """recipes/vf_arith_grpo_cpu.yaml (a verifiers taskset, its own rewards) from the demo's SFT model."""
    pytest.importorskip("verifiers.v1", reason="pip install -e .[verifiers]")
    base, sft, grpo = tmp_path / "base", tmp_path / "sft", tmp_path / "grpo"
    for argv in (["assets", "tiny-model", *BASE_MODEL_ARGS, "--out", str(base)],
                 ["train", "recipes/calc_sft_cpu.yaml", f"model.path={base}", f"run.dir={sft}"],
                 ["train", "recipes/vf_arith_grpo_cpu.yaml", f"model.path={sft / 'hf'}", f"run.dir={grpo}"]):
        proc = hybridrl(*argv)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    vals = [(r["step"], r["val/accuracy"]) for r in read_metrics(grpo) if r.get("val/accuracy") is not None]
    print(json.dumps({"recipe": "vf_arith", "validation": vals}))
    assert vals[0][0] == 0 and vals[-1][0] <= 20
    assert 100 * (vals[-1][1] - vals[0][1]) >= 20, vals
