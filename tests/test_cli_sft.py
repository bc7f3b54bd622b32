"""SFT measures itself, as a user runs it: `hybridrl sft RECIPE` with its output going to a file
prints progress lines (step, loss, s/step, ETA), validates greedy and sampled accuracy on the
task's validation split during and after training (metrics.jsonl, run.json), and ends with a
one-line verdict; `hybridrl eval` gives the same greedy accuracy for the exported model."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hybridrl.evaluate import verdict
from hybridrl.telemetry.metrics import read_metrics
from tests.launch import ROOT, env_with_repo

SFT = ROOT / "recipes" / "calc_sft_cpu.yaml"
SMALL = ("sft.steps=20", "sft.num_demonstrations=256", "sft.batch_size=32", "sft.log_every=5",
         "train.lr_warmup_steps=2", "train.lr_decay_steps=20", "train.micro_batch_size=16",
         "task.validation_size=12", "agent.max_turns=2", "agent.max_new_tokens_per_turn=16",
         "agent.max_response_tokens=40")


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_models):
    model = tiny_models("qwen2", init_std=0.05)
    run_dir = tmp_path_factory.mktemp("sft")
    log = run_dir.parent / f"{run_dir.name}.log"
    with log.open("w") as out:                       # not a terminal: what a user's `> sft.log` gives
        proc = subprocess.run([sys.executable, "-m", "hybridrl", "sft", str(SFT), f"model.path={model}",
                               f"run.dir={run_dir}", "sft.validate_every=10", *SMALL],
                              cwd=ROOT, env=env_with_repo(), stdout=out, stderr=subprocess.STDOUT, timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return run_dir, text, model


def test_progress_lines_when_the_output_is_a_file(sft_run):
    _, text, _ = sft_run
    lines = [line for line in text.splitlines() if line.startswith("sft step ") and "s/step" in line]
    steps = [int(re.match(r"sft step (\d+)/20", line)[1]) for line in lines]
    assert steps == list(range(2, 21, 2)), lines               # a line per 10%
    assert re.search(r"sft step 10/20 \(50%\): loss \d+\.\d{4}, \d+\.\d\d s/step, ETA \d+s", text), lines
    assert "ETA" not in lines[-1]


def test_sft_validates_greedy_and_sampled_and_says_what_it_means(sft_run):
    run_dir, text, _ = sft_run
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for step in (10, 20):                                      # every 10 steps, the last one included
        row = rows[step]
        assert row["val/episodes"] == 12 and row["val/temperature_sampled"] == 1.0
        for key in ("val/accuracy", "val/accuracy_sampled", "val/reward", "val/tool_calls_sampled",
                    "val/response_tokens", "val/seconds"):
            assert key in row, key
        assert 0.0 <= row["val/accuracy"] <= 1.0 and row["val/successes_sampled"] == round(
            12 * row["val/accuracy_sampled"])
    assert "val/accuracy" not in rows[5] and "sft/loss" in rows[20]
    final = rows[20]
    expected = verdict(final["val/accuracy"], final["val/accuracy_sampled"],
                       successes=final["val/successes_sampled"], temperature=1.0)
    assert f"sft: validation on 12 held-out instances: {expected}" in text
    record = json.loads((run_dir / "run.json").read_text())
    assert record["validation_accuracy"] == final["val/accuracy"]
    assert record["validation_accuracy_sampled"] == final["val/accuracy_sampled"]
    assert record["validation_verdict"] == expected
    assert not (run_dir / "val_hf").exists()                   # the intermediate export is removed
    assert json.loads((run_dir / "config.json").read_text())["run"]["job"] == "sft"   # kept, as an RL run's


def test_eval_of_the_exported_model_agrees_with_the_sft_validation(sft_run, tmp_path):
    run_dir, _, model = sft_run
    out = subprocess.run([sys.executable, "-m", "hybridrl", "eval", str(SFT), f"model.path={model}",
                          "--model", str(run_dir), *SMALL[-4:], "--json", str(tmp_path / "eval.json")],
                         cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["model"] == str(run_dir / "hf") and result["instances"] == 12   # a run dir means its hf/
    final = read_metrics(run_dir)[-1]
    # greedy decoding of the same model on the same 12 questions; the engine batches them differently
    # (one engine here, one per rank there), which may flip a near-tie
    assert abs(result["greedy"]["accuracy"] - final["val/accuracy"]) <= 1 / 12 + 1e-9
    assert out.stdout.strip().splitlines()[-1] == result["verdict"]
    assert "greedy" in out.stdout and "sampled T=1" in out.stdout


@pytest.mark.parametrize("greedy, sampled, successes, says", [
    (0.0, 0.0, 0, "no sample succeeded: warm start longer"),
    (0.0, 0.25, 3, "RL has a signal"),
    (0.5, 0.04, 1, "weak signal"),
    (1.0, 1.0, 12, "nothing left to learn"),
])
def test_the_verdict(greedy, sampled, successes, says):
    line = verdict(greedy, sampled, successes=successes, temperature=1.0)
    assert line.startswith(f"greedy {100 * greedy:.1f}%, sampled {100 * sampled:.1f}% (T=1): ") and says in line
