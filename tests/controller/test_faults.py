"""Faults injected into real runs (torchrun, 2 CPU ranks, SIGKILL): whatever moment of a step the
job dies at, the resumed run is bitwise the uninterrupted one; a killed worker rank with
trainer.max_restarts comes back by itself. The fast case (kill_job@3:train) is in test_rl_e2e.py;
this matrix is `slow`."""

from __future__ import annotations

import json
import signal

import pytest

from hybridrl.controller.faults import check, parse
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, assert_same_run, hybridrl_train
from tests.launch import processes_mentioning

COMMON = ["trainer.total_steps=4", "trainer.checkpoint_every=2"]


def test_fault_specs_are_checked_with_clear_errors():
    assert parse("kill_job@3:train").moment == "train" and parse("kill_rank1@2").rank == 1
    assert parse("kill_rank@2").moment == "rollout"
    for bad, why in (("kill_job@0", "count from 1"), ("boom@2", "expected KIND@STEP"),
                     ("kill_job@2:later", "unknown moment"), ("kill_rank0@2", "rank 0 is the controller")):
        with pytest.raises(ValueError, match=why):
            check([bad], checkpoint_every=2)
    with pytest.raises(ValueError, match="writes no checkpoint"):
        check(["kill_job@3:checkpoint"], checkpoint_every=2)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", init_std=0.05)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, model):
    run_dir = tmp_path_factory.mktemp("straight")
    proc = hybridrl_train(RECIPE, f"model.path={model}", *COMMON, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["kill_job@3:switch", "kill_job@3:rollout", "kill_job@3:log",
                                  "kill_job@4:checkpoint"])
def test_a_job_killed_at_any_moment_resumes_bitwise(tmp_path, model, straight, spec):
    run_dir = tmp_path / "run"
    args = [f"model.path={model}", *COMMON, f"run.dir={run_dir}", "--inject", spec]
    proc = hybridrl_train(RECIPE, *args)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    assert not processes_mentioning(str(run_dir))
    if spec.endswith("checkpoint"):                 # the model of step 4 is written, its COMPLETE is not
        partial = run_dir / "checkpoints" / "step_000004"
        assert (partial / "trainer_state.json").exists() and not (partial / "COMPLETE").exists()
    proc = hybridrl_train(RECIPE, *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming from" in proc.stderr and "step_000002" in proc.stderr
    assert_same_run(straight, run_dir)
    fired = [json.loads(line)["spec"] for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert fired == [spec]


@pytest.mark.slow
def test_a_killed_rank_restarts_by_itself_and_resumes_bitwise(tmp_path, model, straight):
    run_dir = tmp_path / "run"
    proc = hybridrl_train(RECIPE, f"model.path={model}", *COMMON, f"run.dir={run_dir}", "trainer.max_restarts=1",
                          "--inject", "kill_rank@3:rollout")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fault injection: kill_rank@3:rollout" in proc.stderr
    assert "restart 1 of at most 1: trainer.resume=auto" in proc.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    assert_same_run(straight, run_dir)


@pytest.mark.slow
def test_a_rank_killed_before_the_first_checkpoint_starts_over(tmp_path, model, straight):
    run_dir = tmp_path / "run"
    proc = hybridrl_train(RECIPE, f"model.path={model}", *COMMON, f"run.dir={run_dir}", "trainer.max_restarts=1",
                          "--inject", "kill_rank@1:train")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "restart 1 of at most 1: trainer.resume=never" in proc.stderr
    assert_same_run(straight, run_dir, from_step=1)
