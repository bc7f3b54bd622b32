"""Weight updates without draining in the disaggregated placement (1 training + 1 rollout rank, gloo):
`rollout.native.on_weight_update=continue`. The next step's groups run while the update trains; its
publication lands on them between two engine steps, and each running episode goes on as a new segment of
the new version. Every token keeps the version that sampled it, with that version's logprob: the v0
segments equal the reference model's forward (the v0 weights), the v1 segments the trainer's own forward
at v1. Landing at a fixed engine step after the grant keeps two runs side by side on a busy machine equal;
landing at the first step after the weights arrive makes no request wait for them."""

from __future__ import annotations

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_determinism import TIMING, two_runs_under_load
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train

IN_FLIGHT = ("placement.mode=disaggregated", "placement.rollout_ranks=1", "algo.max_policy_lag=1",
             "rollout.native.on_weight_update=continue",
             # a learning signal without rewards (the tiny model earns none), so that versions differ
             "algo.kl_coef=0.01", "algo.kl_in=reward", "train.lr=1e-2", "train.lr_warmup_steps=0",
             # turns far longer than the update's engine step, so that it lands on running requests
             "agent.max_new_tokens_per_turn=96", "agent.max_response_tokens=200")
# the engine's wait at the update's step is a timing too
IN_FLIGHT_TIMING = (*TIMING, "engine/update_hold_s", "engine/update_late_steps")


@pytest.fixture(scope="module")
def model(rl_model):
    return rl_model


def _tokens(run_dir, step: int) -> list[dict]:
    from hybridrl.inspect.query import RunLedger

    ledger = RunLedger(run_dir)
    return [ledger.data_row(t) for t in ledger.select(step=step)]


def assert_every_token_is_its_versions(run_dir, steps=(2, 3)) -> dict[str, float]:
    """Per token: its version never decreases along the trajectory and is at most one behind the update;
    the behaviour logprob of a v(s-1) token equals the trainer's recompute at v(s-1) (old logprobs), of a v0
    token the reference model's (v0 weights). Returns the largest differences seen."""
    worst = {"same_version": 0.0, "v0_vs_ref": 0.0, "newer_vs_ref": 0.0, "mixed": 0.0}
    for step in steps:
        trained_at = step - 1
        for row in _tokens(run_dir, step):
            pairs = [(v, b, o, r) for v, b, o, r, m in zip(row["policy_versions"], row["behavior_logprobs"],
                                                            row["old_logprobs"], row["ref_logprobs"],
                                                            row["response_mask"]) if m]
            versions = [v for v, *_ in pairs]
            assert versions == sorted(versions) and set(versions) <= {trained_at - 1, trained_at}
            worst["mixed"] += len(set(versions)) > 1
            for v, behaviour, old, ref in pairs:
                if v == trained_at:
                    worst["same_version"] = max(worst["same_version"], abs(behaviour - old))
                if v == 0:
                    worst["v0_vs_ref"] = max(worst["v0_vs_ref"], abs(behaviour - ref))
                elif v > 0:
                    worst["newer_vs_ref"] = max(worst["newer_vs_ref"], abs(behaviour - ref))
    return worst


def assert_equal_runs(a, b) -> list[dict]:
    """Every logged number but timings equal at every step, and the exported weights bitwise; returns a's rows."""
    import torch
    from safetensors.torch import load_file

    ra, rb = read_metrics(a), read_metrics(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        cx = {k: v for k, v in x.items() if not k.startswith(IN_FLIGHT_TIMING)}
        cy = {k: v for k, v in y.items() if not k.startswith(IN_FLIGHT_TIMING)}
        assert cx == cy, (x["step"], sorted({k for k in cx.keys() | cy.keys() if cx.get(k) != cy.get(k)}))
    wa, wb = load_file(str(a / "hf" / "model.safetensors")), load_file(str(b / "hf" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return ra


@pytest.fixture(scope="module")
def at_a_fixed_step(tmp_path_factory, model):
    """Two runs side by side under load, each update landing 4 engine steps after the grant."""
    return two_runs_under_load(tmp_path_factory.mktemp("fixed"), [
        *IN_FLIGHT, f"model.path={model}", "trainer.total_steps=6", "rollout.native.update_after_steps=4"])


@pytest.mark.slow
def test_an_update_at_a_fixed_step_lands_on_running_episodes_and_runs_are_equal(at_a_fixed_step):
    a, b = at_a_fixed_step
    rows = assert_equal_runs(a, b)[1:]
    assert all(r["train/updated"] == 1.0 for r in rows)
    for r in rows[1:]:      # from step 2 on, every step's groups ran while the update before it trained
        assert r["engine/updates_mid_request"] == 1 and r["engine/update_continued_requests"] > 0
        assert r["stream/multi_version_episodes"] > 0 and r["engine/update_recompute_tokens"] > 0
        assert r["lag/0"] + r["lag/1"] == r["episodes"] and r["filter/policy_lag"] == 0
        assert r["parity/probed"] == 0.0 and r["publish/refused"] == 0
    worst = assert_every_token_is_its_versions(a)
    assert worst["mixed"] > 0
    assert worst["same_version"] < 1e-4 and worst["v0_vs_ref"] < 1e-4
    assert worst["newer_vs_ref"] > 1e-3          # the v1 tokens are not v0's (nothing relabelled)


@pytest.mark.slow
def test_an_update_at_the_first_step_after_it_arrives_keeps_no_request_waiting(tmp_path, model):
    proc = hybridrl_train(RECIPE, *IN_FLIGHT, f"model.path={model}", f"run.dir={tmp_path}", "trainer.total_steps=3",
                          "rollout.native.update_after_steps=0")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert all(r["engine/update_hold_s"] == 0.0 for r in rows)     # the engine never stopped for an update
    worst = assert_every_token_is_its_versions(tmp_path)           # wherever it landed, the labels are exact
    assert worst["same_version"] < 1e-4 and worst["v0_vs_ref"] < 1e-4


def test_a_lag_above_one_is_refused_at_load_naming_the_key():
    with pytest.raises(ConfigError) as err:
        load_config(str(RECIPE), ["placement.mode=disaggregated", "placement.rollout_ranks=1", "model.path=/m",
                                  "algo.max_policy_lag=2", "rollout.native.on_weight_update=continue"])
    assert "algo.max_policy_lag" in str(err.value) and "on_weight_update" in str(err.value)
    load_config(str(RECIPE), ["placement.mode=disaggregated", "placement.rollout_ranks=1", "model.path=/m",
                              "algo.max_policy_lag=2"])       # draining: any lag


@pytest.mark.slow
def test_kill_9_then_resume_with_updates_in_flight_trains_every_prompt_once_and_bitwise(tmp_path, model):
    """Killed after the step-2 checkpoint and started again: the checkpoint's take lets the groups granted
    ahead end on their version (the update's hold is dropped), and the resumed run is the uninterrupted one."""
    from tests.controller.resume_checks import assert_every_drawn_prompt_trained_once, kill_after_checkpoint
    from tests.controller.test_disaggregated import STREAM_TIMING
    from tests.controller.test_rl_e2e import assert_same_run

    common = [*IN_FLIGHT, f"model.path={model}", "trainer.total_steps=5", "trainer.checkpoint_every=2",
              "rollout.native.update_after_steps=4"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    proc = hybridrl_train(RECIPE, *common, f"run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = kill_after_checkpoint(RECIPE, [*common, f"run.dir={killed}"], killed, step=2)
    held = set(state["collection"]["in_flight"])
    assert held
    proc = hybridrl_train(RECIPE, *common, f"run.dir={killed}", "trainer.resume=auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_every_drawn_prompt_trained_once(killed, 5, held)
    assert_same_run(straight, killed, ignore=(*STREAM_TIMING, "engine/update_hold_s", "engine/update_late_steps"))
    assert sum(r["engine/updates_mid_request"] for r in read_metrics(straight) if r["step"] > 0) >= 2
