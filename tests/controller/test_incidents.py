"""Incidents (hybridrl/controller/incidents.py): each rule on metric dicts (fast), the config's checks,
and real runs (2 CPU ranks, the tiny recipe): a rollout/trainer mismatch spike and a NaN injected as
faults, the NaN stopping the run cleanly with both incidents in the ledger; the same command then
resumes and finishes (slow); and a NaN under `incidents.nan=rollback` rolling the run back to the
checkpoint before it with half the learning rate, kept through a later resume (slow)."""

from __future__ import annotations

import json
import math
import sqlite3

import pytest

from hybridrl.config.fields import ConfigValueError
from hybridrl.controller.faults import parse
from hybridrl.controller.incidents import RULE, IncidentsConfig, IncidentWatch, decide
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train


def _watch(**knobs) -> tuple[IncidentWatch, list[str]]:
    said: list[str] = []
    return IncidentWatch(IncidentsConfig(**knobs), say=said.append), said


def test_nan_or_inf_loss_or_grad_norm_fires_and_stops_by_default():
    watch, said = _watch()
    assert watch.check(1, {"loss": 0.3, "train/grad_norm": 1.2}) == []
    (incident,) = watch.check(2, {"loss": 0.3, "train/grad_norm": float("inf")})
    assert incident.rule == "nan" and incident.action == "stop" and incident.step == 2
    assert incident.evidence == {"values": {"train/grad_norm": "inf"}}
    assert "train.lr" in said[0] and "train/grad_norm=inf" in said[0]       # one line naming the knobs
    assert watch.check(2, {"loss": float("nan")}) == []                        # once per step
    assert [i.evidence for i in watch.check(3, {"loss": float("nan")})] == [{"values": {"loss": "nan"}}]


def test_mismatch_and_kl_fire_above_their_bounds_only():
    watch, _ = _watch(mismatch_max=0.1, kl_max=0.5)
    assert watch.check(1, {"mismatch/mean_abs": 0.1, "kl": 0.5}) == []        # at the bound: quiet
    fired = watch.check(2, {"mismatch/mean_abs": 0.4, "mismatch/max_abs": 2.0, "kl": 0.7})
    assert {i.rule: i.action for i in fired} == {"mismatch": "warn", "kl": "warn"}
    assert RULE["mismatch"].check(IncidentsConfig(), {"mismatch/mean_abs": 0.4}, [])["mismatch/mean_abs"] == 0.4
    assert RULE["kl"].check(IncidentsConfig(kl_max=0.5), {"kl": 0.7}, [])["bound"] == 0.5


def test_all_failed_counts_agent_errors_and_infrastructure_faults():
    rule = RULE["all_failed"].check
    cfg = IncidentsConfig()
    assert rule(cfg, {"episodes": 8, "episodes/agent_errors": 3, "status/infra_invalid": 5}, []) == {
        "episodes": 8, "agent_errors": 3, "infra_invalid": 5}
    assert rule(cfg, {"episodes": 8, "episodes/agent_errors": 3, "status/infra_invalid": 4}, []) is None
    assert rule(cfg, {"episodes": 0}, []) is None


def test_a_drop_from_the_best_over_the_window_fires():
    watch, said = _watch(drop_by=0.2, drop_window=2)
    watch.on_start({"earlier_metrics": [{"step": 0, "val/accuracy": 0.266}, {"step": 1, "reward/mean": 0.1}]})
    for step, acc in ((5, 0.30), (10, 0.25)):
        assert watch.check(step, {"val/accuracy": acc}) == []
        watch.on_step(step, {"val/accuracy": acc})
    (incident,) = watch.check(15, {"val/accuracy": 0.016})
    assert incident.evidence == {"metric": "val/accuracy", "value": 0.016, "best": 0.30, "best_step": 5,
                                 "drop_by": 0.2, "window": 2}
    # a window of one evaluation forgets the best of step 5
    narrow, _ = _watch(drop_by=0.2, drop_window=1)
    for step, acc in ((5, 0.30), (10, 0.10)):
        narrow.on_step(step, {"val/accuracy": acc})
    assert narrow.check(15, {"val/accuracy": 0.016}) == []
    # a rollback forgets what came after its checkpoint (and lets the rules fire again there)
    watch.on_step(15, {"val/accuracy": 0.016})
    watch.rewound(10)
    assert watch.history == [(0, 0.266), (5, 0.30), (10, 0.25)] and watch.check(15, {"val/accuracy": 0.0})


def test_off_rules_never_fire_and_the_most_severe_action_decides():
    watch, said = _watch(nan="off", kl="rollback")
    fired = watch.check(1, {"loss": float("nan"), "kl": 9.0, "mismatch/mean_abs": 1.0})
    assert [i.rule for i in fired] == ["mismatch", "kl"] and len(said) == 2
    assert decide(fired) == "rollback" and decide([]) == "off"
    stop, _ = _watch(kl="rollback")
    assert decide(stop.check(1, {"loss": float("nan"), "kl": 9.0})) == "stop"


def test_the_config_refuses_bad_actions_and_bounds():
    for knobs, field in (({"nan": "panic"}, "nan"), ({"kl_max": 0}, "kl_max"), ({"rollback_lr_scale": 2.0},
                         "rollback_lr_scale"), ({"drop_window": -1}, "drop_window"), ({"drop_metric": ""},
                         "drop_metric")):
        with pytest.raises(ConfigValueError) as err:
            IncidentsConfig(**knobs)
        assert err.value.field == field


def test_a_rollback_needs_the_colocated_sync_loop():
    from hybridrl.config.fields import ConfigError
    from hybridrl.config.loader import load_config

    with pytest.raises(ConfigError, match="incidents.kl.*placement.mode=colocated"):
        load_config(RECIPE, ["model.path=m", "incidents.kl=rollback", "trainer.rollout_mode=partial"])
    assert load_config(RECIPE, ["model.path=m", "incidents.kl=rollback"]).incidents.kl == "rollback"


def test_nan_and_mismatch_faults_fire_in_the_update():
    assert parse("nan@3").moment == "train" and parse("mismatch@2").moment == "train"
    with pytest.raises(ValueError, match="leave the moment out"):
        parse("nan@3:rollout")


# ------------------------------------------------------------------ real runs


def _incidents(run_dir) -> list[dict]:
    db = sqlite3.connect(run_dir / "ledger" / "index.sqlite")
    rows = db.execute("SELECT step, detail FROM events WHERE kind = 'incident' ORDER BY at").fetchall()
    db.close()
    return [{"step": step, **json.loads(detail)} for step, detail in rows]


NAN_RUN = ("trainer.total_steps=2", "trainer.checkpoint_every=1", "trainer.inject=[mismatch@1,nan@2]")


@pytest.fixture(scope="module")
def stopped(rl_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("incident_stop") / "run"
    proc = hybridrl_train(RECIPE, f"model.path={rl_model}", *NAN_RUN, f"run.dir={run_dir}")
    return run_dir, proc


def test_a_nan_stops_the_run_cleanly_with_the_incidents_in_the_ledger(stopped):
    run_dir, proc = stopped
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    mismatch, nan = _incidents(run_dir)
    assert mismatch["step"] == 1 and mismatch["rule"] == "mismatch" and mismatch["taken"] == "warn"
    assert mismatch["evidence"]["mismatch/mean_abs"] > 0.1           # 1 nat on one rank's rows of two
    assert nan["step"] == 2 and nan["rule"] == "nan" and nan["taken"] == "stop"
    assert nan["evidence"]["values"]["loss"] == "nan" and nan["checkpoint"].endswith("step_000001")
    assert "rl: incident at step 2 (nan, stop)" in proc.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]         # step 2 neither logged nor checkpointed
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_000001"]
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "stopped" and "nan" in record["stop_reason"]


def test_a_real_steps_efficiency_metrics_match_the_rows_it_trained_on(stopped, rl_model):
    from hybridrl.controller.efficiency import model_shape, train_flops

    run_dir, _ = stopped
    row = read_metrics(run_dir)[1]
    db = sqlite3.connect(run_dir / "ledger" / "index.sqlite")
    lengths = [p + r for p, r in db.execute("SELECT prompt_tokens, response_tokens FROM trajectories "
                                            "WHERE consumed_step = 1")]
    db.close()
    shape = model_shape(json.loads((rl_model / "config.json").read_text()))
    assert len(lengths) == row["episodes/admitted"] and row["perf/train_flops"] == train_flops(shape, lengths)
    assert row["perf/mfu"] == pytest.approx(row["perf/train_flops"] / (row["time/T_train"] * row["perf/peak_flops"] * 2))
    assert 0 < row["time/grad_reduce_s"] <= row["time/T_comm"] < row["time/step_s"]
    assert row["time/T_checkpoint"] == 0.0                   # no checkpoint before step 1
    assert 0 <= row["perf/prefix_hit_rate"] <= 1 and row["success/per_hour"] == 0.0    # a random model
    assert "success/per_usd" in row


@pytest.mark.slow
def test_the_stopped_run_resumes_with_the_same_command(stopped, rl_model):
    run_dir, _ = stopped
    proc = hybridrl_train(RECIPE, f"model.path={rl_model}", *NAN_RUN, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in rows[1:])
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow
def test_a_rollback_resumes_from_the_checkpoint_before_with_a_lower_learning_rate(rl_model, tmp_path):
    run_dir = tmp_path / "run"
    args = (f"model.path={rl_model}", "trainer.checkpoint_every=2", "trainer.inject=[nan@3]",
            "incidents.nan=rollback", "incidents.rollback_lr_scale=0.5", f"run.dir={run_dir}")
    proc = hybridrl_train(RECIPE, "trainer.total_steps=4", *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (incident,) = _incidents(run_dir)
    assert incident["step"] == 3 and incident["taken"] == "rollback" and incident["resumed_at_step"] == 3
    assert incident["checkpoint"].endswith("step_000002")
    assert incident["lr"] == {"before": pytest.approx(1e-4), "after": pytest.approx(5e-5)}
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]                  # step 3 once: the one done again
    assert [r["train/lr"] for r in rows[1:]] == pytest.approx([1e-4, 1e-4, 5e-5, 5e-5])
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["train/grad_norm"]) for r in rows[1:])
    db = sqlite3.connect(run_dir / "ledger" / "index.sqlite")
    assert [s for (s,) in db.execute("SELECT step FROM steps ORDER BY step")] == [1, 2, 3, 4]
    # the release of the restored version is kept: the engine still served it and published it no more
    assert [v for (v,) in db.execute("SELECT version FROM releases ORDER BY version")] == [1, 2, 3, 4]
    db.close()
    # the lower learning rate is in the checkpoints written after the rollback: a resumed run keeps it
    proc = hybridrl_train(RECIPE, "trainer.total_steps=5", *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert read_metrics(run_dir)[-1]["train/lr"] == pytest.approx(5e-5)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_learning_rate_that_collapses_the_policy_warns_of_the_drop_naming_the_learning_rate(tmp_path):
    """A new user's mistake: GRPO from the demo's SFT warm start at 200x the recipe's learning rate. The
    policy collapses (the demo's SFT model solves ~15% of its sampled episodes before any update, none
    after a few at this rate); the drop rule, watching the training reward here (the greedy held-out
    accuracy of the SFT model is 0 before GRPO, so it has no best to fall from), warns during the run,
    naming train.lr, and the ledger keeps the incident with its evidence."""
    import subprocess
    import sys

    from hybridrl.demo import BASE_MODEL_ARGS
    from tests.launch import ROOT, env_with_repo

    def hybridrl(*argv):
        return subprocess.run([sys.executable, "-m", "hybridrl", *argv], cwd=ROOT, env=env_with_repo(),
                              capture_output=True, text=True, timeout=1800)

    base, sft, grpo = tmp_path / "base", tmp_path / "sft", tmp_path / "grpo"
    for argv in (["assets", "tiny-model", *BASE_MODEL_ARGS, "--out", str(base)],
                 ["train", "recipes/calc_sft_cpu.yaml", f"model.path={base}", f"run.dir={sft}"],
                 ["train", "recipes/calc_grpo_cpu.yaml", f"model.path={sft / 'hf'}", f"run.dir={grpo}",
                  "train.lr=1.0e-2", "train.lr_schedule=constant", "trainer.total_steps=5", "trainer.validate_every=0", "trainer.checkpoint_every=0",
                  "algo.drop_all_equal_groups=false", "incidents.drop_metric=reward/mean", "incidents.drop_by=0.1"]):
        proc = hybridrl(*argv)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rewards = [r["reward/mean"] for r in read_metrics(grpo) if r["step"] >= 1]
    assert rewards[0] > 0.1 and rewards[-1] < rewards[0] - 0.1, rewards          # the policy did collapse
    drops = [i for i in _incidents(grpo) if i["rule"] == "drop"]
    assert drops and all(i["taken"] == "warn" for i in drops), drops
    first = drops[0]
    assert first["evidence"]["best"] - first["evidence"]["value"] > 0.1
    assert f"rl: incident at step {first['step']} (drop, warn)" in proc.stderr and "train.lr" in proc.stderr
