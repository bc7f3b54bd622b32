"""The critic inside the hybrid worker with real ranks: its optimizer state is not resident in the
rollout phase (by the same accounting as the actor's), it shows in the mode machine's phases, and a
checkpoint restores it exactly (the same next step, to the bit)."""

from __future__ import annotations

import json

from tests.controller.test_rl_e2e import hybridrl_train
from tests.workers.test_hybrid import RECIPE


def test_critic_is_offloaded_for_rollout_and_restored_exactly_from_a_checkpoint(tmp_path, tiny_models):
    model = tiny_models("qwen2", init_std=0.1)
    proc = hybridrl_train(RECIPE, "run.job=tests.workers.critic_jobs:MEMORY_AND_CHECKPOINT", f"model.path={model}",
                          f"run.dir={tmp_path}", "algo.advantage=gae", "critic.lr=1e-3", "hybrid.spill_optimizer=true",
                          "trainer.prompts_per_step=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["first"]["loss"] > 0 and r["first"]["grad_norm"] > 0
    opt = r["train"]["critic_optimizer_bytes_held"]
    assert opt > 0 and r["train"]["critic_grad_bytes_held"] > 0
    assert r["rollout"]["critic_optimizer_bytes_held"] == 0 and r["rollout"]["critic_grad_bytes_held"] == 0
    assert r["rollout"]["optimizer_bytes_held"] == 0                       # the actor's left too
    assert r["back"]["critic_optimizer_bytes_held"] == opt
    phases = r["rollout"]["phases"]
    assert phases["critic_offload"]["bytes"] >= opt and phases["critic_train"]["count"] == 1
    assert r["back"]["phases"]["critic_reload"]["bytes"] >= opt
    assert "metadata.json" in r["critic_dir"]
    assert r["after_load"] == r["after_save"]                              # the same step, to the bit
    assert r["values_a"] == r["values_b"]
