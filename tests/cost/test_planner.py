"""The planner's models on workloads whose answer is known by hand: the simulation's step times, the
fits recovering known costs, the recommendation on a straggler-heavy workload, what-if and sizing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hybridrl.cost.fit import workload_from_run
from hybridrl.cost.planner import SHOWN, bound, capacities, default_config, format_plan, plan, reliability, what_if
from hybridrl.cost.records import EpisodeRecord, RunRecords
from hybridrl.cost.simulate import Config, Simulation, simulate
from hybridrl.cost.workload import (EngineModel, EpisodeShape, MeasuredConfig, Overheads, TrainerModel, Turn, Workload,
                                    fit_engine, fit_trainer)


def episode(tokens: int, wait_s: float = 0.0, reward: float = 1.0, turns: int = 1) -> EpisodeShape:
    per = tokens // turns
    ts = [Turn(prompt_tokens=0, generated=per, wait_s=wait_s) for _ in range(turns)]
    ts[-1].wait_s = 0.0
    return EpisodeShape(turns=ts, reward_s=0.0, reward=reward, truncated=False, status="completed", task_id="t")


def workload(groups, *, step_s=0.01, train_s=0.5, per_token_s=0.0, prompts=4, group_size=2) -> Workload:
    return Workload(groups=groups, engine=EngineModel(base_s=step_s, per_seq_s=0.0, per_prefill_token_s=0.0, max_batch=256),
                    trainer=TrainerModel(base_s=train_s, per_token_s=per_token_s), overheads=Overheads(),
                    measured=MeasuredConfig(world_size=1, rollout_ranks=1, prompts_per_step=prompts,
                                            group_size=group_size, drop_truncated=False, drop_all_equal_groups=False))


def sync_cfg(prompts=4, group_size=2, **kw) -> Config:
    return Config(prompts_per_step=prompts, group_size=group_size, drop_truncated=False, drop_all_equal_groups=False, **kw)


def test_a_sync_step_waits_for_its_longest_episode():
    # groups of 10- and 100-token episodes, 10 ms per engine step whatever the batch, a 0.5 s update
    groups = [[episode(10), episode(10)], [episode(100), episode(100)]] * 2
    r = Simulation(workload(groups), sync_cfg(), seed=None).run(steps=3, warmup=0)
    for s in r.steps:
        assert s["rollout_s"] == pytest.approx(100 * 0.01)          # the 100-token episodes decide
        assert s["end"] - s["start"] == pytest.approx(1.0 + 0.5)
        assert s["admitted_tokens"] == 2 * 10 * 2 + 2 * 100 * 2


def test_tool_waits_go_on_while_the_engine_is_off_and_a_batch_shares_its_steps():
    # two turns of 5 tokens with a 0.2 s tool call between: 5 steps, the wait, 5 steps
    groups = [[episode(10, wait_s=0.2, turns=2)] * 2] * 4
    r = Simulation(workload(groups), sync_cfg(), seed=None).run(steps=2, warmup=0)
    assert r.steps[0]["rollout_s"] == pytest.approx(0.05 + 0.2 + 0.05)      # 8 episodes, one batch


def test_partial_rollouts_carry_stragglers_and_the_lag_filter_drops_them():
    groups = [[episode(20), episode(20)]] * 6 + [[episode(400), episode(400)]] * 2
    w = workload(groups, train_s=0.1)
    sync = simulate(w, sync_cfg(), steps=16, seeds=3)
    partial = simulate(w, sync_cfg(rollout_mode="partial", oversample=2.0, max_policy_lag=-1), steps=16, seeds=3)
    assert partial.admitted_tokens_per_s > 1.5 * sync.admitted_tokens_per_s
    assert partial.queue_depth > 0 and max(int(k) for k in partial.lag_histogram) >= 1
    strict = simulate(w, sync_cfg(rollout_mode="partial", oversample=2.0, max_policy_lag=0), steps=16, seeds=3)
    assert set(strict.lag_histogram) == {"0"}                     # every continued episode was dropped
    assert strict.admitted["length_mean"] < partial.admitted["length_mean"]
    assert sum(s.get("filter/policy_lag", 0) for s in strict.steps) > 0


def test_disaggregated_lag_one_overlaps_the_update_lag_zero_does_not():
    groups = [[episode(50), episode(50)]] * 8
    w = workload(groups, train_s=0.5)                    # rollout of a step: 50 x 10 ms = 0.5 s
    base = dict(placement="disaggregated", train_ranks=1, rollout_ranks=1)
    lag0 = simulate(w, sync_cfg(max_policy_lag=0, **base), steps=12, seeds=1)
    lag1 = simulate(w, sync_cfg(max_policy_lag=1, **base), steps=12, seeds=1)
    assert lag0.step_s == pytest.approx(1.0, rel=0.02)             # rollout, then the update
    assert lag1.step_s == pytest.approx(0.5, rel=0.02)             # side by side
    assert lag1.lag_histogram == {"1": lag1.admitted["episodes"]}


def test_fits_recover_known_engine_and_trainer_costs():
    rows = []
    for steps, batch, prefill in ((100, 4, 50), (80, 30, 400), (120, 12, 100), (60, 60, 900)):
        busy = steps * 0.003 + steps * batch * 0.0002 + prefill * 0.00005
        rows.append({"engine/steps": steps, "engine/decode_tokens": steps * batch, "engine/prefill_tokens": prefill,
                     "engine/step_time_s": busy})
    e = fit_engine(rows, ranks=1, max_batch=64)
    assert (e.base_s, e.per_seq_s, e.per_prefill_token_s) == pytest.approx((0.003, 0.0002, 0.00005), rel=1e-6)
    assert e.r2 == pytest.approx(1.0)
    noisy = [dict(r, **{"engine/step_time_s": r["engine/step_time_s"] * f}) for r, f in zip(rows, (4.0, 1.0, 0.25, 1.0))]
    assert fit_engine(noisy, ranks=1, max_batch=64).r2 < 0.5
    # a constant update (a fixed cost) over widely varying tokens is found constant ...
    const = fit_trainer([{"tokens/admitted": t, "time/T_train": 0.3 + 0.001 * (i % 2)}
                         for i, t in enumerate((1000, 4000, 2000, 7000, 1500, 5000))], ranks=1)
    assert const.base_s == pytest.approx(0.3, rel=0.01)
    assert const.seconds(7000, 1) == pytest.approx(0.3, rel=0.01) and const.seconds(7000, 4) == pytest.approx(0.3, rel=0.01)
    # ... while tokens that barely vary cannot tell: all of it follows the tokens per rank
    flat = fit_trainer([{"tokens/admitted": t, "time/T_train": 1.0} for t in (1900, 2000, 2100)], ranks=2)
    assert flat.base_s == 0.0 and flat.seconds(2000, 1) == pytest.approx(2.0, rel=0.01)


def test_the_plan_recommends_partial_rollouts_for_stragglers_and_explains_itself():
    groups = [[episode(20, reward=r), episode(20, reward=1 - r)] for r in (0, 1)] * 3 + [[episode(400), episode(400)]]
    w = workload(groups, train_s=0.1)
    out = plan(w, placements=("colocated",), steps=16)
    rec = out["recommended"]
    assert not rec["is_default"] and rec["config"]["rollout_mode"] == "partial"
    assert rec["speedup_over_default"] > 1.3
    assert "trainer.rollout_mode=partial" in rec["overrides"]
    assert rec["queue_bounds"]["groups_in_flight"] == rec["config"]["prompts_per_step"] * rec["config"]["oversample"]
    assert {"rollout", "train", "env", "reward"} <= set(out["measured"]["capacities"])
    assert all(c["how"] for c in out["measured"]["capacities"].values())
    assert out["cannot_know"]
    json.dumps(out, default=str)                                   # --json can write it


def test_what_if_and_sizing_for_a_target():
    groups = [[episode(40), episode(40)]] * 8
    w = workload(groups, train_s=0.0, per_token_s=0.001)
    bigger = what_if(w, {"model_scale": 4})
    assert bigger.trainer.per_token_s == pytest.approx(0.004) and w.trainer.per_token_s == pytest.approx(0.001)
    cfg = default_config(w, 1)
    assert capacities(bigger, cfg)["train"]["tokens_per_s"] == pytest.approx(capacities(w, cfg)["train"]["tokens_per_s"] / 4)
    slow_tools = what_if(workload([[episode(40, wait_s=0.1, turns=2)] * 2] * 8), {"tool_latency_s": 0.5})
    assert slow_tools.groups[0][0].turns[0].wait_s == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown"):
        what_if(w, {"gpu_count": 2})
    sized = plan(w, target=5000.0, placements=("colocated",), steps=8)
    t = sized["target"]
    assert t["ranks"] > 1 and t["bound_tokens_per_s"] * t["headroom"] >= 5000.0
    assert sized["recommended"]["config"]["train_ranks"] == t["ranks"]
    smaller = plan(w, target=t["bound_tokens_per_s"] * t["headroom"] / t["ranks"] * (t["ranks"] - 1) * 0.99,
                   placements=("colocated",), steps=8)
    assert smaller["target"]["ranks"] <= t["ranks"] - 1          # the smallest count that reaches it


def test_plan_cli_errors_are_one_line(tmp_path, capsys):
    from hybridrl.cli import main

    assert main(["plan"]) == 2
    assert "give a RUN_DIR" in capsys.readouterr().err
    assert main(["plan", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert main(["plan", str(tmp_path), "--what-if", "model_scale"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err
    assert main(["cost", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.slow
def test_measure_runs_the_engine_at_each_batch_and_prompt_and_times_the_tools(tiny_models):
    from hybridrl.cost.measure import measure_engine, measure_tools

    model, rows = measure_engine(str(tiny_models("qwen2")), batches=(1, 4), prompt_tokens=(8, 24), new_tokens=3,
                                 kv_cache_mb=8, max_num_seqs=8, repeats=1)
    assert [(r["batch"], r["prompt_tokens"]) for r in rows] == [(1, 8), (4, 8), (1, 24), (4, 24)]
    for r in rows:       # the prefill step samples the first token, decode steps the other 2; no prefix cache
        assert r["engine/decode_tokens"] == r["batch"] * 2 and r["engine/steps"] == 3
        assert r["engine/prefill_tokens"] == r["batch"] * r["prompt_tokens"]
    assert min(model.base_s, model.per_seq_s, model.per_prefill_token_s) >= 0 and model.max_batch == 8
    assert "--measure" in model.how
    tools = measure_tools(calls=2, sandbox_runs=1)
    assert tools["calculator_call_s"] > 0 and "sandbox" in tools


def agent_run() -> RunRecords:
    """The ledger and metrics of a 4-step `task.agent` run (tests/cost/agent_run.json, read back from a real
    run: tests/gateway/rl_agent.py through the gateway): its episodes carry counts, no per-turn trace."""
    data = json.loads((Path(__file__).parent / "agent_run.json").read_text())
    episodes = [EpisodeRecord(**e, filter_reason=None, success=e["reward"] >= 1.0, lag=0) for e in data["episodes"]]
    return RunRecords(run_dir=Path("agent-run"), config=data["config"], rows=data["rows"],
                      marks=[{"mark": "start", "world_size": data["world_size"]}], episodes=episodes, has_ledger=True,
                      pruned_steps=[])


def test_a_task_agent_run_plans_and_its_poor_fits_are_flagged():
    rec = agent_run()
    assert not any(e.turn_events for e in rec.episodes)
    w = workload_from_run(rec)
    shapes = {id(s): s for g in w.groups for s in g}.values()
    assert sum(s.policy_tokens for s in shapes) == sum(e.policy_tokens for e in rec.episodes if e.step > 0)
    assert sorted(len(s.turns) for s in shapes) == sorted(e.turns for e in rec.episodes if e.step > 0)
    assert any("no per-turn trace" in n for n in w.notes)
    out = plan(w, steps=8)
    assert out["measured"]["bound"]["tokens_per_s"] > 0 and out["recommended"]["predicted"]["admitted_tokens_per_s"] > 0
    flagged = {u["model"]: u for u in out["unreliable"]}
    assert flagged["engine"]["r2"] < 0.5 and "R^2 0.32" in flagged["engine"]["why"]
    text = format_plan(out)
    assert "UNRELIABLE engine fit" in text and "(from an unreliable fit: see above)" in text
    table = text.split("candidate ", 1)[1].split("\n\nrecommended", 1)[0].splitlines()[1:]
    listed = [line for line in table if "<-" in line or line.startswith("  colocated") or line.startswith("  disagg")]
    assert len(listed) <= SHOWN + 2 < len(out["candidates"])
    assert f"{len(out['candidates']) - len(listed)} more candidate(s)" in text
    assert any("<- recommended" in line for line in listed) and any("default" in line for line in listed)
    assert all(c["label"] in format_plan(out, all_rows=True) for c in out["candidates"])


def test_a_stage_that_admits_nothing_bounds_the_throughput_at_zero():
    """Every group all-equal and dropped: no stage admits a token; the bound says 0, it does not divide by it
    (the verifier timed, C_reward is 0 too; untimed, it is no bound, and says why)."""
    timed = dataclasses.replace(episode(20, reward=1.0), reward_s=0.001)
    for ep, reward in ((timed, 0.0), (episode(20, reward=1.0), float("inf"))):
        w = workload([[ep, ep]] * 4, per_token_s=0.001)
        cfg = dataclasses.replace(default_config(w, 1), drop_all_equal_groups=True)
        caps = capacities(w, cfg)
        assert (caps["rollout"]["tokens_per_s"], caps["train"]["tokens_per_s"]) == (0, 0)
        assert caps["reward"]["tokens_per_s"] == reward
        for placement in ("colocated", "disaggregated"):
            assert bound(w, dataclasses.replace(cfg, placement=placement), caps)["tokens_per_s"] == 0
    assert "not timed" in caps["reward"]["how"]
    assert reliability(w) == []                           # hand-made models: nothing fitted to judge
