"""Faults injected into real runs (torchrun, 2 CPU ranks, SIGKILL): whatever moment of a step the
job dies at, the resumed run is bitwise the uninterrupted one; a killed worker rank with
trainer.max_restarts comes back by itself; a crashed engine or a raising verifier leaves only its
trajectories infrastructure-invalid (never trained on) while every step trains the same prompts; a
full disk at a checkpoint stops the run, which comes back by itself from the checkpoint before.
The fast cases (kill_job@3:train in test_rl_e2e.py, the engine and reward faults here) run by
default; the rest is `slow`. The environment service killed between commit and reply is in
tests/envs/test_env_replay.py (the rollout process) and below (a whole RL run, slow)."""

from __future__ import annotations

import json
import signal

import pytest

from hybridrl.controller.faults import check, parse
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT
from tests.controller.test_rl_e2e import RECIPE, assert_same_run, hybridrl_train
from tests.launch import processes_mentioning

COMMON = list(STRAIGHT)


def test_fault_specs_are_checked_with_clear_errors():
    assert parse("kill_job@3:train").moment == "train" and parse("kill_rank1@2").rank == 1
    assert parse("kill_rank@2").moment == "rollout"
    assert parse("engine@2").moment == "rollout" and parse("disk_full@4").moment == "checkpoint"
    for bad, why in (("kill_job@0", "count from 1"), ("boom@2", "expected KIND@STEP"),
                     ("kill_job@2:later", "unknown moment"), ("kill_rank0@2", "rank 0 is the controller"),
                     ("engine@2:train", "leave the moment out"), ("disk_full@3", "writes no checkpoint")):
        with pytest.raises(ValueError, match=why):
            check([bad], checkpoint_every=2)
    with pytest.raises(ValueError, match="writes no checkpoint"):
        check(["kill_job@3:checkpoint"], checkpoint_every=2)


@pytest.fixture(scope="module")
def model(rl_model):
    return rl_model


@pytest.fixture(scope="module")
def straight(straight_run):                  # the uninterrupted run with COMMON (tests/controller/conftest.py)
    return straight_run


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


def _prompts_by_step(run_dir):
    from hybridrl.inspect.query import RunLedger

    ledger = RunLedger(run_dir)
    return ledger, {s["step"]: sorted({t["task_id"] for t in ledger.select(step=s["step"])}) for s in ledger.steps()}


def test_a_crashed_engine_and_a_raising_verifier_invalidate_only_their_episodes(tmp_path, model, straight):
    run_dir = tmp_path / "run"
    proc = hybridrl_train(RECIPE, f"model.path={model}", *COMMON, f"run.dir={run_dir}",
                          "--inject", "engine@2", "--inject", "reward@3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for step, kind in ((2, "engine"), (3, "reward")):
        bad = rows[step].get("status/infra_invalid", 0)
        assert bad >= 1 and rows[step]["filter/infra_invalid"] == bad, (step, rows[step])
        assert rows[step]["episodes/admitted"] == rows[step]["episodes"] - bad
    assert rows[3]["status/infra_invalid"] == 1                   # the verifier raised once
    assert "status/infra_invalid" not in rows[1] and "status/infra_invalid" not in rows[4]
    ledger, prompts = _prompts_by_step(run_dir)
    assert prompts == _prompts_by_step(straight)[1]                # every step drew the same prompts
    for t in ledger.select():
        if t["status"] == "infra_invalid":                       # counted, never trained on, reason kept
            assert t["consumed_step"] is None and t["filter_reason"] == "infra_invalid"
            assert ("fault injection: engine@2" in t["end_reason"]) == (t["step"] == 2)
            assert t["step"] != 3 or "evaluator error" in t["end_reason"]
        else:
            assert t["consumed_step"] == t["step"]
    fired = [json.loads(line)["spec"] for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert fired == ["engine@2", "reward@3"]


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_stops_the_run_which_resumes_from_the_one_before(tmp_path, model, straight):
    run_dir = tmp_path / "run"
    proc = hybridrl_train(RECIPE, f"model.path={model}", *COMMON, f"run.dir={run_dir}", "trainer.max_restarts=1",
                          "--inject", "disk_full@4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "No space left on device (fault injection: disk_full@4)" in proc.stderr and "save_checkpoint" in proc.stderr
    assert "restart 1 of at most 1: trainer.resume=auto" in proc.stderr and "step_000002" in proc.stderr
    assert_same_run(straight, run_dir)


@pytest.mark.slow
def test_the_env_service_killed_between_commit_and_reply_executes_no_action_twice(tmp_path, model):
    """A stateful task (guess_number) through the leased service in RL: the rollout rank dies right
    after a commit; the restarted run resumes from its checkpoint and runs that step's episodes again
    under the same keys: what was committed is answered from the record."""
    import sqlite3

    run_dir = tmp_path / "run"
    # a random model never ends a turn by itself: closing the turn at its token budget sends every
    # turn's text to the environment, so each episode takes environment steps
    proc = hybridrl_train(RECIPE, f"model.path={model}", *COMMON, f"run.dir={run_dir}", "task.name=guess_number",
                          "agent.on_turn_limit=close_turn", "trainer.max_restarts=1", "--inject", "env_kill@3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "restart 1 of at most 1: trainer.resume=auto" in proc.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]
    con = sqlite3.connect(run_dir / "envs.sqlite")
    keys = [k for (k,) in con.execute("SELECT idempotency_key FROM transitions")]
    assert len(keys) == len(set(keys))                             # one transition per key
    kinds = [k for (k,) in con.execute("SELECT kind FROM events")]
    assert kinds.count("replay") >= 1                              # the dead attempt's commits came back
    assert kinds.count("step") == len(keys)                        # every recorded step executed once
