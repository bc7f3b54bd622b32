"""Shared by the RL-loop tests: the tiny recipe's model and its uninterrupted 4-step run (a checkpoint
every 2 steps), made once per session: the run the end-to-end checks read and the reference that every
resume and fault test must reproduce."""

from __future__ import annotations

import pytest

STRAIGHT = ("trainer.total_steps=4", "trainer.checkpoint_every=2")


@pytest.fixture(scope="session")
def rl_model(tiny_models):
    return tiny_models("qwen2", init_std=0.05)


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory, rl_model):
    from tests.controller.test_rl_e2e import RECIPE, hybridrl_train

    run_dir = tmp_path_factory.mktemp("straight")
    proc = hybridrl_train(RECIPE, f"model.path={rl_model}", *STRAIGHT, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir
