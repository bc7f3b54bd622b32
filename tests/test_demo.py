"""`hybridrl demo`: plan and overrides (fast), a one-step miniature through every stage (fast), and
the real demo reaching its target (slow)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridrl.demo import split_overrides
from hybridrl.telemetry.metrics import read_metrics
from tests.inspect.ledger_checks import check_html_page, check_ledger_answers
from tests.launch import ROOT, env_with_repo

# the miniature: a few SFT steps and one GRPO step, just enough for every stage to run for real
TINY = ["sft:sft.steps=3", "sft:sft.num_demonstrations=32", "sft:sft.batch_size=8", "sft:sft.log_every=1",
        "sft:train.lr_warmup_steps=1", "sft:train.micro_batch_size=4",
        "grpo:trainer.total_steps=1", "grpo:trainer.prompts_per_step=2", "grpo:trainer.group_size=2",
        "grpo:task.validation_size=4", "grpo:trainer.checkpoint_every=0", "grpo:train.micro_batch_size=4",
        "grpo:rollout.native.kv_cache_mb=8", "grpo:algo.drop_all_equal_groups=false",
        "grpo:publish.bucket_mb=1", "agent.max_new_tokens_per_turn=8", "agent.max_response_tokens=32"]


def demo(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", "demo", *args], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=timeout)


def test_overrides_go_to_both_stages_or_one():
    out = split_overrides(["task.seed=7", "sft:sft.steps=5", "grpo:trainer.total_steps=2", "task.options.ops=+-"])
    assert out == {"sft": ["task.seed=7", "sft.steps=5", "task.options.ops=+-"],
                   "grpo": ["task.seed=7", "trainer.total_steps=2", "task.options.ops=+-"]}
    for bad in (["run.dir=x"], ["grpo:model.path=y"], ["sft:steps"]):
        with pytest.raises(ValueError):
            split_overrides(bad)


def test_dry_run_prints_the_plan_and_validates_both_configs(tmp_path):
    proc = demo("--dir", str(tmp_path), "--dry-run", "task.seed=7", "grpo:trainer.total_steps=3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "[1/3] base model", "[2/3] SFT warm start", "[3/3] GRPO with the calculator"]
    assert all("(run)" in line for line in lines)
    assert f"--out {tmp_path / 'base'}" in lines[0]
    assert f"model.path={tmp_path / 'base'}" in lines[1] and "task.seed=7" in lines[1]
    assert "trainer.total_steps" not in lines[1]
    assert f"model.path={tmp_path / 'sft' / 'hf'}" in lines[2] and "trainer.total_steps=3" in lines[2]
    assert not any(tmp_path.iterdir())                     # nothing ran, nothing was written
    bad = demo("--dir", str(tmp_path), "--dry-run", "grpo:trainer.total_step=3")
    assert bad.returncode == 2 and "trainer.total_step" in bad.stderr


def test_miniature_runs_every_stage_reads_its_numbers_from_the_runs_and_reuses_them(tmp_path, tiny_models):
    base = tiny_models("qwen2", init_std=0.05)
    out = tmp_path / "demo"
    args = ["--dir", str(out), "--base-model", str(base), *TINY]
    proc = demo(*args, "--json", str(tmp_path / "summary.json"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == json.loads((out / "summary.json").read_text())
    vals = [(r["step"], r["val/accuracy"]) for r in read_metrics(out / "grpo") if "val/accuracy" in r]
    assert [step for step, _ in vals] == [0, 1]
    assert summary["sft_accuracy"] == vals[0][1] and summary["final_accuracy"] == vals[1][1]
    assert summary["improvement_points"] == pytest.approx(100 * (vals[1][1] - vals[0][1]))
    assert summary["sft_final_loss"] == read_metrics(out / "sft")[-1]["sft/loss"]
    assert not any(s["cached"] for s in summary["stages"].values())
    assert (out / "sft" / "hf" / "config.json").exists() and (out / "grpo" / "hf" / "config.json").exists()
    assert "SFT model (step 0)" in proc.stdout and "improvement" in proc.stdout
    assert (out / "sft.log").read_text().startswith("$ ") and (out / "grpo.log").exists()
    # the run ledger answers the trace questions for every GRPO episode, and its page renders
    check_html_page(out / "grpo", tmp_path / "page.html", check_ledger_answers(out / "grpo"))

    plan = demo(*args, "--dry-run").stdout
    assert "SFT warm start (reuse)" in plan and "GRPO with the calculator (reuse)" in plan
    plan = demo(*args, "grpo:task.validation_size=2", "--dry-run").stdout   # a changed stage runs again
    assert "SFT warm start (reuse)" in plan and "GRPO with the calculator (run)" in plan
    again = demo(*args)                                     # same command: both stages reused, nothing runs
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("done before") == 2
    assert json.loads((out / "summary.json").read_text())["final_accuracy"] == summary["final_accuracy"]


VARIANTS = {"default": [], "task_seed_7": ["task.seed=7"], "3_to_4_digit_operands": ["task.options.min_digits=3"]}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_demo_improves_validation_accuracy_by_25_points_within_15_minutes(tmp_path, variant):
    proc = demo("--dir", str(tmp_path), *VARIANTS[variant], timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(variant, json.dumps({k: summary[k] for k in ("sft_accuracy", "final_accuracy", "improvement_points",
                                                        "stages", "seconds_this_run")}))
    assert summary["improvement_points"] >= 25, summary
    assert summary["seconds_this_run"] < 15 * 60, summary
