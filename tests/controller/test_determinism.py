"""Two uninterrupted runs of the same command, side by side on a busy machine (busy loops beside them, as
`tests/run_loaded.py` runs the suite), are equal in every number they log but timings and in their final
weights, in each collection: colocated sync, colocated partial rollouts, and the disaggregated placement
with a lag bound of 1 (generation one update ahead of training) and of 0 (rollout and training take turns).

Long responses make generation outlast an update, so in the disaggregated placement a publication
arrives while the next step's groups run, and in partial rollouts the quorum is counted while episodes
are half-way through a turn: exactly where timing used to decide what was trained."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import _TIMING, RECIPE
from tests.launch import ROOT, env_with_repo

# waits and idle time of the stream collection are timings too
TIMING = (*_TIMING, "stream/trainer_wait_s", "stream/rollout_idle_s")
LONG = ("trainer.total_steps=6", "agent.max_new_tokens_per_turn=128", "agent.max_response_tokens=384")
DISAGGREGATED = ("placement.mode=disaggregated", "placement.rollout_ranks=1")
LOOPS_PER_CORE = 1          # beside two jobs of two ranks each: the machine is oversubscribed either way

# each loop asks the kernel to SIGKILL it when the test process dies, then spins
BUSY = ("import ctypes, os, signal, sys\n"
        "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
        "if os.getppid() != int(sys.argv[1]):\n    sys.exit(0)\n"
        "while True:\n    pass\n")


@pytest.fixture(scope="module")
def model(rl_model):
    return rl_model


def _train(run_dir, overrides) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), *overrides, f"run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def two_runs_under_load(tmp_path, overrides) -> tuple:
    """The same command twice, at the same time, beside busy loops; both must succeed."""
    loops = [subprocess.Popen([sys.executable, "-c", BUSY, str(os.getpid())])
             for _ in range(LOOPS_PER_CORE * len(os.sched_getaffinity(0)))]
    dirs = (tmp_path / "a", tmp_path / "b")
    jobs = [_train(d, overrides) for d in dirs]
    try:
        for job in jobs:
            _, err = job.communicate(timeout=900)
            assert job.returncode == 0, err[-4000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)       # torchrun and its ranks
        for p in (*loops, *jobs):
            p.kill()
            p.wait()
    return dirs


def assert_identical(a, b) -> list[dict]:
    """Every logged number but timings equal at every step, and the exported weights bitwise; returns a's rows."""
    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(7))
    for x, y in zip(ra, rb):
        cx = {k: v for k, v in x.items() if not k.startswith(TIMING)}
        cy = {k: v for k, v in y.items() if not k.startswith(TIMING)}
        assert cx == cy, (x["step"], sorted({k for k in cx.keys() | cy.keys() if cx.get(k) != cy.get(k)}))
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "hf" / "model.safetensors")), load_file(str(b / "hf" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return ra


def test_disaggregated_one_update_ahead_is_the_same_run_twice_under_load(tmp_path, model):
    """A publication waits for the groups running on the version served (they end on it); before, the
    publication landed mid-episode and the version split of a trajectory followed the clock."""
    a, b = two_runs_under_load(tmp_path, [f"model.path={model}", *DISAGGREGATED, "algo.max_policy_lag=1", *LONG])
    rows = assert_identical(a, b)[1:]
    assert all(r["train/updated"] == 1.0 for r in rows)
    # each group ran on one version: the one before the update it enters (lag 1 from step 2 on)
    assert all(r["stream/multi_version_episodes"] == 0 for r in rows)
    assert all(r["lag/1"] == r["episodes"] for r in rows[1:])
    # the engine counters are compared too: read once nothing runs, a step's hold the groups generated
    # while it trained (the next step's), so the last step's are zero
    assert all(r["engine/decode_tokens"] > 0 for r in rows[:-1]) and rows[-1]["engine/decode_tokens"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("sync", ()),
    ("partial", ("trainer.rollout_mode=partial", "trainer.oversample=1.5")),
    ("disaggregated-lag0", (*DISAGGREGATED, "algo.max_policy_lag=0")),
])
def test_every_other_collection_is_the_same_run_twice_under_load(tmp_path, model, name, overrides):
    a, b = two_runs_under_load(tmp_path, [f"model.path={model}", *overrides, *LONG])
    rows = assert_identical(a, b)[1:]
    assert all(r["train/updated"] == 1.0 for r in rows)
    if name == "partial":            # the case this checks: episodes carried over and continued
        assert sum(r["partial/interrupted"] for r in rows) > 0 and sum(r["partial/continued_episodes"] for r in rows) > 0


@pytest.mark.slow
def test_partial_episodes_in_flight_at_a_checkpoint_continue_after_kill_9_as_a_new_segment(tmp_path, model):
    """Partial rollouts, checkpoint every step, the whole job SIGKILLed in step 3 and resumed from the step-2
    checkpoint, which holds episodes paused mid-turn: the run equals the uninterrupted one in every number
    but timings and in its weights, and each saved episode is trained as one trajectory whose first
    tokens after the resume continue the saved ones (its v1 segment kept, a v2 segment after it)."""
    import pickle

    from hybridrl.inspect.query import RunLedger
    from tests.controller.test_rl_e2e import assert_same_run, kill_9_then_resume

    common = [f"model.path={model}", "trainer.rollout_mode=partial", "trainer.oversample=3", "trainer.prompts_per_step=2",
              "trainer.total_steps=4", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=4",
              "agent.max_new_tokens_per_turn=128", "agent.max_response_tokens=384"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "train", str(RECIPE), *common, f"run.dir={straight}"],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kill_9_then_resume(straight, killed, common)          # bitwise from step 3 on, weights included
    assert_same_run(straight, killed, from_step=1)        # (and before: the same command up to the kill)
    state = pickle.loads((killed / "checkpoints" / "step_000002" / "trainer_state.pkl").read_bytes())
    saved = [s for g in state["collection"]["held"] for s in g.saved]
    assert saved                                          # the checkpoint held episodes paused mid-turn
    ledger = RunLedger(killed)
    trained = {r["id"]: r for r in ledger.select() if r["consumed_step"] is not None}
    for s in saved:
        row = ledger.data_row(trained[s.traj.trajectory_id])
        before = s.traj.response_ids + [t for seg in s.turn.segments for t in seg.token_ids]
        versions = s.traj.policy_versions + [seg.policy_version for seg in s.turn.segments for _ in seg.token_ids]
        assert row["response_ids"][:len(before)] == before           # continued, not generated again
        assert row["policy_versions"][:len(before)] == versions and set(versions) == {1}
        assert row["policy_versions"][len(before):] and set(row["policy_versions"][len(before):]) >= {2}
        assert row["metadata"]["restored"] >= 1 and row["metadata"]["interruptions"] >= 1
