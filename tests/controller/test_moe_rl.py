"""A mixture-of-experts policy through the RL loop with real ranks: a tiny Qwen3-MoE, its experts split
over both ranks (train.ep=2), rollout routing replay on (algo.router_replay=rollout), and kill -9 +
resume=auto reproducing the uninterrupted run's numbers and weights."""

from __future__ import annotations

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train, kill_9_then_resume

MOE = ("train.ep=2", "algo.router_replay=rollout")


@pytest.mark.slow
def test_moe_run_replays_the_rollouts_routing_and_resumes_exactly(tmp_path, tiny_models):
    model = tiny_models("qwen3_moe", experts=8, experts_per_tok=2, init_std=0.05)
    common = [f"model.path={model}", *STRAIGHT, *MOE]
    straight = tmp_path / "straight"
    proc = hybridrl_train(RECIPE, *common, f"run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(straight)
    for r in rows[1:]:
        # the trainer's routers used exactly the experts the native engine recorded, prompt and tool
        # results included (every token but each sequence's last has a record) ...
        assert r["moe/replay_agreement"] == 1.0 and r["moe/recorded_fraction"] > 0.8, r
        assert 0.0 < r["moe/router_agreement"] <= 1.0
        # ... so the trainer scores what the engine sampled
        assert r["mismatch/max_abs"] < 1e-4, r

    kill_9_then_resume(straight, tmp_path / "killed", common)


@pytest.mark.slow
def test_an_openai_client_agents_moe_run_replays_the_rollouts_routing(tmp_path, tiny_models):
    """Routing replay through the gateway: the same MoE run with an agent written with the OpenAI client
    (task.agent) records the rollout's routes for its tokens and the trainer replays them, as the built-in
    loop's run does (the gateway's episodes come out of the same episode engine)."""
    model = tiny_models("qwen3_moe", experts=8, experts_per_tok=2, init_std=0.05)
    run_dir = tmp_path / "agent"
    proc = hybridrl_train(RECIPE, f"model.path={model}", "trainer.total_steps=3", *MOE, f"run.dir={run_dir}",
                          "task.agent=tests.gateway.rl_agent:run", "gateway.tool_parser=none",
                          "gateway.reasoning_parser=none", "distributed.heartbeat_timeout_s=120")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_metrics(run_dir) if r.get("step", 0) >= 1 and "moe/recorded_fraction" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["moe/recorded_fraction"] >= 0.9 and r["moe/replay_agreement"] == 1.0, r
        assert r["mismatch/max_abs"] < 1e-4, r


@pytest.mark.slow
def test_a_moe_engine_serving_the_trainers_parameters_in_place_trains_the_same_run(tmp_path, tiny_models):
    """`rollout.native.trainer_weights=share` with experts split over the ranks: the engine serves the trainer's
    dense tensors and router in place and copies the rest (q/k/v, the experts); number for number the run that
    copies everything."""
    from tests.controller.test_rl_e2e import assert_same_run

    model = tiny_models("qwen3_moe", experts=8, experts_per_tok=2, init_std=0.05)
    runs, logs = {}, {}
    for mode in ("copy", "share"):
        runs[mode] = tmp_path / mode
        proc = hybridrl_train(RECIPE, f"model.path={model}", "trainer.total_steps=3", *MOE, f"run.dir={runs[mode]}",
                              f"rollout.native.trainer_weights={mode}")
        assert proc.returncode == 0, proc.stderr[-4000:]
        logs[mode] = proc.stderr
    assert "of the trainer's parameters in place" in logs["share"] and "in place" not in logs["copy"]
    assert_same_run(runs["copy"], runs["share"], from_step=0)
