"""What a run tells its user, replayed with real ranks through `hybridrl train` (2 ranks, the coin task:
a guess is right half the time):

- a run from a model with a learning signal: progress lines in a log file, the end-of-run summary
  (reward, entropy, tool use), callbacks of the user's own and a Weights & Biases stand-in hearing
  every event, MLflow missing said in one line, no "dead run" diagnosis, release lines that say what
  each publication was for (`hybridrl inspect`), the final weights exported again from the last
  checkpoint (`hybridrl export`);
- the same run interrupted by Ctrl-C after its step-2 checkpoint: exit 130, one line naming the step,
  the checkpoint and the command, `interrupted` in run.json, where the ranks were in a log file, no
  traceback on the console; the same command then resumes to the uninterrupted run's numbers and
  weights, bitwise (validation at the checkpoint's step included);
- the same run from a random model: the diagnosis and the fix by step 3, then the stop that
  `trainer.stop_after_dead_steps=3` asks for.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, assert_same_run
from tests.launch import ROOT, env_with_repo, kill_tree, processes_mentioning

TRACKERS = ROOT / "tests" / "controller" / "fake_trackers"
COIN = ("task.name=tests.controller.coin_task:CoinTask", "trainer.total_steps=4", "trainer.validate_every=2",
        "trainer.checkpoint_every=2", "trainer.callbacks=[tests.controller.recording_callback:Recorder,wandb,mlflow]")


def _env(run_dir: Path) -> dict:
    env = env_with_repo({"FAKE_WANDB_LOG": str(run_dir.parent / f"{run_dir.name}.wandb.jsonl")})
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}{os.pathsep}{TRACKERS}"      # `import wandb` finds the stand-in
    return env


def train(run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), *COIN, *overrides, f"run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, env=_env(run_dir), capture_output=True, text=True, timeout=timeout)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def models(rl_model, tmp_path_factory):
    """(a random model: never writes an answer; a short warm start on the coin task: answers, right half the time)."""
    from tests.controller.signal_models import warm_start

    warm = tmp_path_factory.mktemp("coin") / "warm"
    return rl_model, warm_start(rl_model, warm, "tests.controller.coin_task:CoinTask", steps=60)


@pytest.fixture(scope="module")
def reference(models, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("coin_reference") / "run"
    proc = train(run_dir, f"model.path={models[1]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, proc


def test_a_run_with_a_signal_reports_progress_summary_and_events(reference):
    run_dir, proc = reference
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["groups/informative"] > 0 for r in rows[1:])           # every step has something to learn
    assert "no learning signal" not in proc.stderr + proc.stdout
    # progress lines although stderr is a pipe: step, reward, loss, seconds per step, ETA
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rl: step ")]
    assert [line.split()[2] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all("reward " in line and "loss " in line and "s/step" in line for line in lines)
    assert all("ETA" in line for line in lines[:-1]) and "val accuracy" in lines[1]
    # the end-of-run summary: reward, entropy and tool use from the first step to the last
    trend = next(line for line in proc.stdout.splitlines() if line.startswith("rl: first step -> last:"))
    first, last = rows[1], rows[-1]
    assert f"reward {first['reward/mean']:.3f} -> {last['reward/mean']:.3f}" in trend
    assert f"entropy {first['train/entropy']:.3f} -> {last['train/entropy']:.3f}" in trend
    assert "episodes calling a tool 0.0% -> 0.0%" in trend

    seen = events(run_dir)
    assert seen[0] == {"event": "start", "step": 0, "total_steps": 4, "resumed_from": None, "total_steps_in_config": 4}
    assert seen[-1]["event"] == "end" and seen[-1]["summary"]["steps"] == 4
    assert [(e["event"], e["step"]) for e in seen[1:-1]] == [
        ("step", 0), ("validation", 0), ("step", 1), ("step", 2), ("validation", 2), ("checkpoint", 2), ("step", 3),
        ("step", 4), ("validation", 4), ("checkpoint", 4)]
    logged = {r["step"]: r for r in rows}
    for e in seen:
        if e["event"] == "step":        # what the callback got is what metrics.jsonl holds
            assert {k: v for k, v in e["metrics"].items() if v == v} == \
                {k: v for k, v in logged[e["step"]].items() if k != "step" and v is not None}
    wandb = [json.loads(line) for line in (run_dir.parent / "run.wandb.jsonl").read_text().splitlines()]
    assert wandb[0]["call"] == "init" and wandb[0]["total_steps"] == 4 and wandb[0]["name"] == "rl-tiny"
    assert [w["step"] for w in wandb if w["call"] == "log"] == [0, 1, 2, 3, 4]
    assert [w["call"] for w in wandb[-2:]] == ["summary.update", "finish"]
    # every rank's peak resident memory, in run.json and the summary (a rank holding torch and two models: > 100 MiB)
    peak = json.loads((run_dir / "run.json").read_text())["peak_rss_mib"]
    assert len(peak) == 2 and all(100 < v < 24 * 1024 for v in peak), peak
    assert seen[-1]["summary"]["peak_rss_mib"] == peak
    assert f"rl: peak resident memory per rank (MiB): {peak[0]:.0f}, {peak[1]:.0f}" in proc.stdout
    missing = [line for line in proc.stderr.splitlines() if "mlflow is not installed" in line]
    assert len(missing) == 1 and "pip install mlflow" in missing[0] and "off for this run" in missing[0]


def test_inspect_says_what_each_release_was_published_for(reference):
    run_dir, _ = reference
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "inspect", str(run_dir)], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    releases = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("release v")]
    by_version = {int(line.split()[1][1:]): line for line in releases}
    # v1 (step 1's update) served step 2's rollout; v2 (step 2's update) was published for the validation after
    # step 2 and served step 3 as it was; v3 for step 4's rollout; v4 for the last validation
    assert "(the update of step 1)" in by_version[1] and by_version[1].endswith("published at step 2 for its rollout")
    assert "(the update of step 2)" in by_version[2]
    assert by_version[2].endswith("published at step 2 for the validation after its update")
    assert by_version[3].endswith("published at step 4 for its rollout")
    assert by_version[4].endswith("published at step 4 for the validation after its update")
    assert "no learning signal" not in proc.stdout


COIN_SUITE = """
suite: coin_check
version: 1
description: the coin run's held-out tosses, greedy and 4 samples at T=1
entries:
  - {task: "tests.controller.coin_task:CoinTask", split: validation, seeds: "0", size: 8}
sampling:
  - {name: greedy, temperature: 0.0, samples: 1}
  - {name: sampled, temperature: 1.0, samples: 4}
pass_k: [1, 2, 4]
metrics: [accuracy, pass@k, reward, tool_calls, length]
agent: {max_turns: 3, max_new_tokens_per_turn: 12, max_response_tokens: 40}
"""


@pytest.mark.slow              # evaluates every checkpoint of the shared run: ~11 s (tests/evaluate covers eval runs)
def test_eval_of_a_runs_checkpoints_is_its_validation_and_pass_at_k_counts_the_samples(reference, tmp_path):
    """`hybridrl eval SUITE --run RUN --checkpoints 2,4 --compare` on the run's own held-out instances under
    its episode budgets: greedy accuracy is the trainer's validation at those steps; pass@k is the share of
    k-subsets of each instance's samples holding a success (counted by enumeration), averaged."""
    import itertools

    from PIL import Image

    run_dir, _ = reference
    suite = tmp_path / "coin_check.yaml"
    suite.write_text(COIN_SUITE)
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "eval", str(suite), "--run", str(run_dir),
                           "--checkpoints", "2,4", "--compare", "--no-progress", "--json", str(tmp_path / "r.json")],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["model"]["step"]: r for r in json.loads((tmp_path / "r.json").read_text())}
    assert sorted(results) == [2, 4]
    validation = {r["step"]: r["val/accuracy"] for r in read_metrics(run_dir) if "val/accuracy" in r}
    greedy = {step: r["metrics"]["sampling"]["greedy"]["accuracy"] for step, r in results.items()}
    assert greedy == {step: validation[step] for step in (2, 4)}, (greedy, validation)
    assert 0.0 < greedy[4] < 1.0                       # a guesser: the comparison is not one of zeros
    out = run_dir / "eval" / "coin_check"
    for step, result in results.items():
        records = [json.loads(line) for line in (out / f"step_{step:06d}.episodes.jsonl").read_text().splitlines()]
        samples: dict[str, list[bool]] = {}
        for r in records:
            if r.get("sampling") == "sampled":
                samples.setdefault(r["task_id"], []).append(bool(r["correct"]))
        assert len(samples) == 8 and all(len(v) == 4 for v in samples.values())
        for k in (1, 2, 4):
            counted = sum(statistics.fmean(any(c) for c in itertools.combinations(v, k)) for v in samples.values())
            assert result["metrics"]["sampling"]["sampled"][f"pass@{k}"] == pytest.approx(counted / len(samples))
    png = Image.open(out / "compare.png")
    assert png.size[0] >= 600 and png.size[1] >= 200
    assert len(set(png.convert("L").getdata())) > 8          # drawn on: more than a blank page's few greys
    # the run's page draws the same results across its checkpoints (from the ledger, where eval recorded them)
    page = tmp_path / "run.html"
    shown = subprocess.run([sys.executable, "-m", "hybridrl", "inspect", str(run_dir), "--html", str(page)], cwd=ROOT,
                           env=env_with_repo(), capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    text = page.read_text()
    blob = text.split('id="ledger-data">', 1)[1].split("</script>", 1)[0]
    series = {s["name"]: s["points"] for s in json.loads(blob)["evaluations"]}
    assert series["coin_check greedy accuracy"] == [[2, greedy[2]], [4, greedy[4]]]
    assert series["coin_check sampled pass@4"] == [[s, results[s]["metrics"]["sampling"]["sampled"]["pass@4"]]
                                                   for s in (2, 4)]
    assert "evaluation-curve" in text


def test_export_of_the_last_checkpoint_equals_the_runs_own_export(reference, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_dir, _ = reference
    cli = [sys.executable, "-m", "hybridrl", "export", str(run_dir)]
    refused = subprocess.run([*cli, "--step", "3", "--out", str(tmp_path / "x")], cwd=ROOT, env=env_with_repo(),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no complete checkpoint of step 3" in refused.stderr
    assert "complete: 2, 4" in refused.stderr and not (tmp_path / "x").exists()
    proc = subprocess.run([*cli, "--step", "4", "--out", str(tmp_path / "step4")], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"exported step 4 of {run_dir}" in proc.stdout
    AutoModelForCausalLM.from_pretrained(tmp_path / "step4")              # what a user does with it
    exported = load_file(str(tmp_path / "step4" / "model.safetensors"))
    final = load_file(str(run_dir / "hf" / "model.safetensors"))
    assert exported.keys() == final.keys()
    assert all((exported[k] == final[k]).all() for k in final)


def _signal_after(path: Path, job: subprocess.Popen, delay: float, sig: int, timeout: float = 600) -> None:
    """Once `path` exists, `delay` s later: SIGINT as a terminal's Ctrl-C sends it (to the job's whole
    process group), SIGTERM as `kill PID` does (to `hybridrl train` alone)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert job.poll() is None, f"the run ended (exit {job.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)
    time.sleep(delay)
    if sig == signal.SIGINT:
        os.killpg(job.pid, sig)
    else:
        job.send_signal(sig)


def interrupt_and_resume(run_dir: Path, model: Path, wait_for: str, delay: float,
                         sig: int = signal.SIGINT, hold_at: int | None = None) -> tuple[str, str]:
    """`sig` once `run_dir/wait_for` exists (+ `delay`), then the same command; returns (stderr of the
    interrupted run, stderr of the resumed one). `hold_at`: the interrupted run's recording callback
    holds it once checkpoint `hold_at` is complete (tests/controller/recording_callback.py)."""
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), *COIN, f"model.path={model}", f"run.dir={run_dir}"]
    log = run_dir.parent / f"{run_dir.name}.interrupted.log"
    env = _env(run_dir) | ({"RECORDER_HOLD_AT_CHECKPOINT": str(hold_at)} if hold_at is not None else {})
    with log.open("w") as err:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                               start_new_session=True)
        try:
            _signal_after(run_dir / wait_for, job, delay, sig)
            assert job.wait(timeout=120) == 128 + sig
        finally:
            if job.poll() is None:
                kill_tree(job.pid)
    deadline = time.monotonic() + 30
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_mentioning(str(run_dir))
    resumed = subprocess.run(cmd, cwd=ROOT, env=_env(run_dir), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    return log.read_text(), resumed.stderr


def test_ctrl_c_says_how_to_resume_and_the_same_command_resumes_bitwise(reference, models, tmp_path):
    ref_dir, _ = reference
    run_dir = tmp_path / "run"
    # held by the recording callback once checkpoint 2 is complete: the signal lands there however fast the
    # machine runs steps 3 and 4 (a fixed delay after the checkpoint once let a fast machine reach step 4)
    interrupted, resumed = interrupt_and_resume(run_dir, models[1], "held", 0.1, hold_at=2)
    said = [line for line in interrupted.splitlines() if line.startswith("hybridrl: rl interrupted")]
    assert len(said) == 1, interrupted[-3000:]
    assert "by SIGINT after step 2 of 4" in said[0]
    assert "the newest checkpoint is step 2" in said[0] and str(run_dir / "checkpoints" / "step_000002") in said[0]
    command = shlex.join(["hybridrl", "train", os.path.relpath(RECIPE, ROOT), *COIN, f"model.path={models[1]}",
                          f"run.dir={run_dir}"])                   # quoted where a shell needs it: pasted, it runs
    assert said[0].endswith(f"the same command resumes from it: {command}")
    assert "Traceback" not in interrupted and "torch.distributed.elastic" not in interrupted
    stacks = (run_dir / "interrupted.log").read_text()
    assert "=== " in stacks and "rank 0: rl interrupted by SIGINT" in stacks and "rank 1: stopping" in stacks
    assert "resuming from" in resumed
    assert [e["event"] for e in events(run_dir)].count("interrupt") == 1
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "finished" and "signal" not in record
    assert_same_run(ref_dir, run_dir, from_step=0)


def test_a_run_without_a_signal_says_why_by_step_3_and_stops_when_told(models, tmp_path):
    run_dir = tmp_path / "dead"
    proc = train(run_dir, f"model.path={models[0]}", "trainer.total_steps=6", "trainer.validate_every=0",
                 "trainer.checkpoint_every=0", "trainer.stop_after_dead_steps=3", "trainer.callbacks=[]")
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("rl: no learning signal in steps 1-3:")]
    assert len(said) == 1
    step3 = next(i for i, line in enumerate(lines) if line.startswith("rl: step 3/6"))
    step4 = [line for line in lines if line.startswith("rl: step 4/6")]
    assert said[0] > step3 and not step4                                 # said after step 3, and stopped there
    assert "no sample succeeded in 48 episodes: the policy never solves the task" in lines[said[0]]
    assert all(fix in lines[said[0]] for fix in ("sft.steps", "task.sft_tool_use_fraction", "task.format_weight",
                                                  "trainer.dynamic_sampling"))
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]
    assert "rl: stopped at step 3 of 6: 3 steps in a row without a learning signal" in proc.stdout
    assert json.loads((run_dir / "run.json").read_text())["status"] == "stopped"
    shown = subprocess.run([sys.executable, "-m", "hybridrl", "inspect", str(run_dir)], cwd=ROOT, env=env_with_repo(),
                           capture_output=True, text=True, timeout=120)
    assert "no learning signal in steps 1-3: no sample succeeded in 48 episodes" in shown.stdout


@pytest.mark.slow
@pytest.mark.parametrize("moment, wait_for, delay, sig", [
    ("early", "ledger/data/step_000001.parquet", (0.0, 1.5), signal.SIGINT),    # in step 2 or its checkpoint
    ("inside_the_save", "checkpoints/step_000002", (0.0, 0.0), signal.SIGINT),  # as checkpoint 2 is written
    ("late", "ledger/data/step_000003.parquet", (0.0, 0.5), signal.SIGTERM),    # in step 4 or its validation
])
def test_an_interrupt_at_a_random_moment_then_the_same_command_is_the_uninterrupted_run(reference, models, tmp_path,
                                                                                        moment, wait_for, delay, sig):
    import random

    pause = random.Random(moment).uniform(*delay)
    print(f"{signal.Signals(sig).name} {pause:.2f}s after {wait_for} appeared")
    run_dir = tmp_path / "run"
    interrupted, _ = interrupt_and_resume(run_dir, models[1], wait_for, pause, sig)
    assert "Traceback" not in interrupted
    said = [line for line in interrupted.splitlines() if line.startswith("hybridrl: rl interrupted")]
    assert len(said) == 1 and f"by {signal.Signals(sig).name}" in said[0]
    assert_same_run(reference[0], run_dir, from_step=0)
