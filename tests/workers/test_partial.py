"""Partial rollouts with real ranks: an episode interrupted at v0 continues on the published v1 and
keeps both segments, each token with the version and the behaviour logprob of the policy that sampled it."""

from __future__ import annotations

import json

import pytest

from tests.controller.test_rl_e2e import hybridrl_train
from tests.launch import ROOT

RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("qwen2", init_std=0.1)


def test_a_trajectory_continued_across_a_weight_update_keeps_both_versions(tmp_path, model):
    proc = hybridrl_train(RECIPE, "run.job=tests.workers.partial_jobs:CONTINUED",
                          f"model.path={model}", f"run.dir={tmp_path}", "train.lr=1e-2", "train.lr_warmup_steps=0",
                          "algo.kl_coef=0.01", "algo.kl_in=reward", "publish.parity_prompts=0",
                          # turns far longer than the v0 window (one slice of engine steps), so every
                          # episode is mid-turn when it ends
                          "agent.max_new_tokens_per_turn=96", "agent.max_response_tokens=200")
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "result.json").read_text())
    assert r["held"] > 0 and r["first_versions"] in ([], [0])
    for rank in r["window"]:    # every rank's episodes were all inside a request when the v0 window ended
        assert rank["stopped_by"] == "quorum" and rank["interrupted"] == rank["live"] > 0 and rank["live_tokens"] > 0
    assert r["stopped_by"] == ["drained", "drained"] and r["live_after"] == [0, 0]
    assert r["mixed"] > 0 and r["v0_tokens"] > 0 and r["v1_tokens"] > 0
    assert all(n >= 1 for n in r["interruptions"])
    assert r["v0_vs_ref"] < 1e-4            # the v0 segment was sampled by the v0 weights
    assert r["v1_vs_actor"] < 1e-4          # the v1 segment by the v1 weights ...
    assert r["v1_vs_ref"] > 1e-3            # ... which differ from v0 on those tokens (nothing relabelled)
    assert r["newest_mask_is_v1"]
