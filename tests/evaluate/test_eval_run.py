"""A two-task mixture trained with real ranks (2 CPU ranks, partial rollouts, calculator + guess_number),
then evaluated from the command line with the suite of its held-out instances (mix_tiny.yaml): every step
reports each task's groups and share, validation covers both tasks, and `hybridrl eval --run` scores each
task of the run's final model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hybridrl.telemetry.metrics import read_metrics
from tests.launch import ROOT, env_with_repo

RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"
SUITE = Path(__file__).with_name("mix_tiny.yaml")
MIXTURE = ("task.name=mixture",
           "task.mixture=[{name: calculator, weight: 1, validation_size: 4},"
           " {name: guess_number, weight: 1, validation_size: 4, options: {max_value: 32}}]",
           "trainer.rollout_mode=partial", "trainer.oversample=2.0", "trainer.total_steps=3",
           "trainer.validate_every=0", "trainer.checkpoint_every=3")


def test_a_mixture_run_keeps_both_tasks_and_evaluates_per_task(tiny_models, tmp_path):
    rl_model = tiny_models("qwen2", init_std=0.05)         # the controller tests' tiny model
    run_dir = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "hybridrl", "train", str(RECIPE), f"model.path={rl_model}",
                            *MIXTURE, f"run.dir={run_dir}"], cwd=ROOT, env=env_with_repo(), capture_output=True,
                           text=True, timeout=900)
    assert train.returncode == 0, train.stderr[-4000:]
    steps = [r for r in read_metrics(run_dir) if "task/calculator/groups" in r]
    assert len(steps) == 3
    for r in steps:
        groups = r["task/calculator/groups"] + r["task/guess_number/groups"]
        assert groups > 0 and abs(r["task/calculator/share"] + r["task/guess_number/share"] - 1.0) < 1e-9
    assert sum(r["task/guess_number/groups"] for r in steps) > 0 and sum(r["task/calculator/groups"] for r in steps) > 0
    final = [r for r in read_metrics(run_dir) if "val/episodes" in r][-1]
    assert final["val/episodes"] == 8                       # 4 held-out instances of each task

    proc = subprocess.run([sys.executable, "-m", "hybridrl", "eval", str(SUITE), "--run", str(run_dir),
                           "--checkpoints", "last", "--no-progress", "--json", str(tmp_path / "r.json")],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["model"]["step"] == 3 and result["instances"] == 8
    assert set(result["metrics"]["per_task"]) == {"calculator", "guess_number"}
    assert result["episodes"] == 8 * (1 + 4)                # greedy once, 4 samples each
    assert "calculator/greedy" in proc.stdout and "guess_number/greedy" in proc.stdout
