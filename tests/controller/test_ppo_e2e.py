"""PPO with a critic (algo.advantage=gae) end to end with real ranks: the warm-up steps train only
the critic, the critic learns from the returns, and kill -9 + resume=auto continues to the same
numbers (critic and actor).

A random tiny model earns no task reward; the runs put a KL penalty in the reward
(algo.kl_in=reward) and an entropy bonus (so the actor moves away from the reference from its
first update): the returns the critic fits are then non-zero."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, _comparable, hybridrl_train
from tests.launch import ROOT, env_with_repo, kill_tree, processes_mentioning

GAE = ["algo.advantage=gae", "algo.kl_coef=0.5", "algo.kl_in=reward", "algo.entropy_coef=0.05", "critic.lr=1e-3",
       "train.lr=1e-3"]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", init_std=0.05)


@pytest.mark.slow
def test_gae_run_warms_up_the_critic_then_trains_both(tmp_path, model):
    proc = hybridrl_train(RECIPE, f"model.path={model}", f"run.dir={tmp_path}", *GAE, "critic.warmup_steps=1",
                          "trainer.total_steps=3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    one, two, three = rows[1], rows[2], rows[3]
    assert one["train/updated"] == 0 and one["policy/version"] == 0 and "train/loss" not in one
    assert "critic/loss" in one and one["critic/lr"] == pytest.approx(1e-3)
    assert two["train/updated"] == 1 and two["policy/version"] == 1
    assert three["policy/version"] == 2
    # from step 3 the actor differs from the reference: KL rewards, returns and a value loss that is not 0
    assert three["critic/loss"] > 0 and three["critic/grad_norm"] > 0 and three["critic/return"] != 0
    assert "critic/value_clip_fraction" in three and "train/pg_loss" in three


@pytest.mark.slow
def test_gae_kill_9_then_resume_auto_continues_to_the_same_numbers(tmp_path, model):
    common = [f"model.path={model}", "trainer.total_steps=4", "trainer.checkpoint_every=2", *GAE]
    straight = tmp_path / "straight"
    proc = hybridrl_train(RECIPE, *common, f"run.dir={straight}")
    assert proc.returncode == 0, proc.stderr[-4000:]

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), *common, f"run.dir={killed}"]
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    marker = killed / "checkpoints" / "step_000002" / "COMPLETE"
    deadline = time.monotonic() + 300
    while not marker.exists() and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the run never completed its step-2 checkpoint"
    assert (killed / "checkpoints" / "step_000002" / "critic" / "metadata.json").exists()
    for p in processes_mentioning(str(killed)):   # kill -9 every rank and the launcher mid-step-3
        p.send_signal(signal.SIGKILL)
    kill_tree(agent.pid)
    agent.wait(timeout=30)
    assert not processes_mentioning(str(killed))

    proc = hybridrl_train(RECIPE, *common, f"run.dir={killed}", "trainer.resume=auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    a, b = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a[3:], b[3:]):
        assert ra["critic/loss"] > 0
        assert _comparable(ra) == _comparable(rb), (ra["step"], set(_comparable(ra).items()) ^ set(_comparable(rb).items()))
    from safetensors.torch import load_file

    ea, eb = load_file(str(straight / "hf" / "model.safetensors")), load_file(str(killed / "hf" / "model.safetensors"))
    assert all(torch.equal(ea[k], eb[k]) for k in ea)
