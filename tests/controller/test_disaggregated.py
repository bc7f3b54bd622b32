"""The disaggregated placement with real ranks (1 training + 1 rollout rank, gloo): generation runs one
update ahead and every token keeps the version that produced it; publication to the rollout rank is
verified from the engine's own storage; a killed run resumes with every prompt trained once; and the
configurations it cannot run are refused by name before anything starts."""

from __future__ import annotations

import json

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train

DISAGGREGATED = ("placement.mode=disaggregated", "placement.rollout_ranks=1")


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", init_std=0.05)


def test_one_update_ahead_every_token_keeps_its_version(tmp_path, model):
    proc = hybridrl_train(RECIPE, *DISAGGREGATED, "algo.max_policy_lag=1", f"model.path={model}",
                          f"run.dir={tmp_path}", "trainer.total_steps=3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["train/updated"] == 1.0 for r in rows)
    assert [r["policy/version"] for r in rows] == [1.0, 2.0, 3.0]
    # step 1's groups start on v0 and train at v0. Each later step's groups are granted right after the
    # step before took its own, before its update, with the floor of a lag of 1: they may start on the
    # version being trained (none waits), so their tokens are that version or the next (how many of
    # each depends on timing), always within the bound and never filtered
    assert rows[0]["lag/0"] == rows[0]["episodes"]
    assert rows[0]["mismatch/max_abs"] < 1e-4     # on-policy there: the rollout rank samples what the trainer scores
    groups = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert [sorted(g["in_flight"]) for g in groups[:2]] == [sorted(g["returned"]) for g in groups[1:]]
    for r in rows:
        assert r["stream/floor_waits"] == 0 and r["lag/2"] == 0 and r["lag/3+"] == 0
        assert r["lag/0"] + r["lag/1"] == r["episodes"] and r["policy/lag_max"] <= 1
        assert r["filter/policy_lag"] == 0
    for r in rows[1:]:
        assert r["publish/refused"] == 0 and r["parity/max_abs"] < 1e-4 and r["switch/publish_s"] > 0
        assert r["parity/probed"] == 1.0
    from hybridrl.inspect.query import RunLedger

    ledger = RunLedger(tmp_path)
    for step in (1, 2, 3):
        trajectories = ledger.select(step=step)
        assert len(trajectories) == 16 and all(t["consumed_step"] == step for t in trajectories)
        # no token is labelled with a version newer than the one being trained, nor older than the bound
        assert all(step - 2 <= t["min_version"] <= t["max_version"] <= step - 1 for t in trajectories)
    assert {r["version"] for r in ledger.releases().values()} >= {1, 2}           # each publication's manifest
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and (tmp_path / "hf" / "config.json").exists()


def test_a_damaged_copy_on_the_rollout_rank_is_copied_again_and_a_persistent_one_stops_the_run(tmp_path, model):
    """The rollout rank's engine storage is damaged after its copy: training rank 0 hears of it from
    the receiver's read-back, sends the tensor again; damage on every copy stops the publication."""
    from tests.workers.hybrid_jobs import CORRUPTED

    proc = hybridrl_train(RECIPE, *DISAGGREGATED, "algo.max_policy_lag=1", "run.job=tests.controller.disaggregated_jobs:CORRUPT",
                          f"model.path={model}", f"run.dir={tmp_path}", "train.lr=1e-2", "train.lr_warmup_steps=0")
    r = json.loads((tmp_path / "result.json").read_text())
    assert proc.returncode != 0
    assert r["retried"]["published"] and r["retried"]["publish/retried_tensors"] == 1
    rollout_rank = r["v1"][0]                                  # rank 0 trains; rank 1 holds the engine
    assert len(r["v1"]) == 1 and all(o["policy_version"] == 1 for o in rollout_rank)   # only it answers
    assert [o["logprobs"] for o in rollout_rank] != [o["logprobs"] for o in r["v0"][0]]
    assert CORRUPTED in r["failure"] and "twice" in r["failure"] and "publish" in r["failure"]


@pytest.mark.parametrize("override, key", [
    ("algo.max_policy_lag=-1", "algo.max_policy_lag"),
    ("trainer.rollout_mode=partial", "trainer.rollout_mode"),
    ("rollout.tp=2", "rollout.tp"),
    ("trainer.dynamic_sampling=true", "trainer.dynamic_sampling"),
    ("run.job=sft", "placement.mode"),
])
def test_what_it_cannot_run_is_refused_at_load_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(str(RECIPE), [*DISAGGREGATED, "algo.max_policy_lag=1", "model.path=/m", override])
    assert key in str(err.value) and "\n" not in str(err.value)


def test_no_training_rank_left_is_refused_before_torchrun(tmp_path, model):
    proc = hybridrl_train(RECIPE, "placement.mode=disaggregated", "placement.rollout_ranks=2", "algo.max_policy_lag=1",
                          f"model.path={model}", f"run.dir={tmp_path}")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "placement.rollout_ranks=2" in lines[0] and "launching" not in proc.stderr


@pytest.mark.slow
def test_kill_9_then_resume_trains_every_drawn_prompt_exactly_once_and_bitwise(tmp_path, model):
    """Killed after the step-2 checkpoint and started again: every drawn prompt trained once, and the run
    equal to an uninterrupted one in every number but timings, and in its final weights. The checkpoint
    takes the groups granted ahead once complete (they ran on the version they started on), and the
    resumed step trains on them."""
    from tests.controller.resume_checks import assert_every_drawn_prompt_trained_once, kill_after_checkpoint
    from tests.controller.test_rl_e2e import assert_same_run

    common = [*DISAGGREGATED, "algo.max_policy_lag=1", f"model.path={model}", "trainer.total_steps=5",
              "trainer.checkpoint_every=2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    proc = hybridrl_train(RECIPE, *common, f"run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = kill_after_checkpoint(RECIPE, [*common, f"run.dir={killed}"], killed, step=2)
    held = set(state["collection"]["in_flight"])
    assert held                                     # step 3's groups were granted before the checkpoint
    proc = hybridrl_train(RECIPE, *common, f"run.dir={killed}", "trainer.resume=auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_every_drawn_prompt_trained_once(killed, 5, held)
    assert all(r["train/updated"] == 1.0 for r in read_metrics(killed) if r["step"] > 0)
    assert_same_run(straight, killed, ignore=STREAM_TIMING)


# the stream collection's waits and idle time are timings too, and so are the engines' counters: a take
# counts the tokens generated since the last one, of groups granted ahead as well as the taken ones
STREAM_TIMING = ("stream/trainer_wait_s", "stream/rollout_idle_s", "engine/")
