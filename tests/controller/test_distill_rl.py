"""On-policy distillation through the RL loop with real ranks: a teacher of another shape scores every step,
its mean per-token reverse KL reaches metrics.jsonl, and kill -9 + resume=auto reproduces the uninterrupted
run's numbers and weights (the teacher is frozen and read from its directory again; nothing of it is state).
Slow (three RL runs); the estimator itself is checked with real ranks in tests/workers/test_distill_worker.py."""

from __future__ import annotations

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train, kill_9_then_resume


@pytest.fixture(scope="module")
def common(tiny_models):
    student = tiny_models("qwen2", init_std=0.05)
    teacher = tiny_models("qwen2", init_std=0.05, layers=3)
    return [f"model.path={student}", f"distill.teacher={teacher}", "distill.reward_weight=0.5", *STRAIGHT]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, common):
    run_dir = tmp_path_factory.mktemp("distill") / "straight"
    proc = hybridrl_train(RECIPE, *common, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


@pytest.mark.slow
def test_every_step_logs_the_reverse_kl_to_the_teacher(straight):
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    for r in rows[1:]:
        assert r["passes/teacher_logprobs"] == 1 and r["passes/old_logprobs"] == 1, r
        assert r["distill/abs_log_ratio"] > 0 and abs(r["distill/reverse_kl"]) <= r["distill/abs_log_ratio"]
        assert r["time/T_teacher"] > 0


@pytest.mark.slow
def test_kill_9_then_resume_auto_continues_a_distillation_run_to_the_same_numbers(tmp_path, common, straight):
    kill_9_then_resume(straight, tmp_path / "killed", common)
