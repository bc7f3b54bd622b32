"""Adapter-only publication of a LoRA run, with real ranks (one 2-rank launch, train.tp=2): the mode
switch carries the adapters only (names and bytes), the native engine applying them at run time gives
the trainer's logprobs (so a wrong scale alpha/rank or a wrong B A product fails here), the merged-weight
path of engines without adapters gives them too, and the checks of any publication still hold: a whole
model or an old version is refused, a damaged copy is copied again, a persistent one stops the run."""

from __future__ import annotations

import json

import pytest

from tests.controller.test_rl_e2e import hybridrl_train
from tests.launch import ROOT
from tests.workers.lora_publish_jobs import DAMAGED

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def result(tmp_path_factory, tiny_models):
    model = tiny_models("qwen2", init_std=0.1)
    out = tmp_path_factory.mktemp("lora_publication")
    proc = hybridrl_train(ROOT / "tests" / "controller" / "rl_tiny.yaml",
                          "run.job=tests.workers.lora_publish_jobs:ADAPTERS", f"model.path={model}", f"run.dir={out}",
                          "train.lr=1e-2", "train.tp=2", f"train.lora.rank={RANK}", f"train.lora.alpha={ALPHA}",
                          "publish.bucket_mb=1")
    assert (out / "result.json").exists() and proc.returncode == 1, proc.stderr[-4000:]   # the last switch fails
    return json.loads((out / "result.json").read_text())


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_a_lora_switch_publishes_only_the_adapters(result):
    carried = result["carried"][0]
    assert carried["names"] == carried["engine_spec"]
    assert carried["names"] and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in carried["names"])
    layers = {n.split(".")[2] for n in carried["names"]}
    assert len(carried["names"]) == 2 * 7 * len(layers)           # A and B of the seven projections per layer
    assert carried["bytes_copied"] == carried["spec_bytes"] > 0
    assert carried["engine_adapter_bytes"] >= carried["spec_bytes"]        # (block-diagonal B: its zeros too)
    assert carried["bytes_copied"] < 0.2 * carried["full_weight_bytes"]
    assert result["switch"]["published"] and result["switch"]["release"]["ready"]


def test_the_engine_applying_adapters_gives_the_trainers_logprobs(result):
    after = result["after"][0]
    assert all(o["policy_version"] == 1 for o in after)
    engine = [o["logprobs"] for o in after]
    assert _max_diff(engine, result["trainer"]) < 1e-4
    assert result["switch"]["parity/max_abs"] < 1e-4                 # the switch's own probe
    # the adapters matter: the published version differs from the base the engine served at v0
    assert _max_diff(engine, [o["logprobs"] for o in result["before"][0]]) > 1e-2


def test_the_merged_path_gives_the_trainers_logprobs_too(result):
    """What SGLang and vLLM take: the whole model with B A merged, every fused group of this tiny model in one
    bucket (each group's B A added to its own tensors only, once)."""
    merged = result["merged"][0]
    assert merged["bytes_copied"] == result["carried"][0]["full_weight_bytes"] and merged["num_buckets"] == 1
    assert _max_diff([o["logprobs"] for o in merged["outputs"]], result["trainer_merged"]) < 1e-4
    assert [o["token_ids"] for o in merged["outputs"]] == [o["token_ids"] for o in result["after"][0]]


def test_a_whole_model_and_an_old_version_are_refused(result):
    for refusals in result["refusals"]:
        assert "refused before any copy" in refusals["whole_model"] and "unknown tensor" in refusals["whole_model"]
        assert "older than the current policy" in refusals["old_version"]
        assert refusals["serving"] == 1


def test_a_damaged_adapter_copy_is_copied_again_and_a_persistent_one_stops_the_run(result):
    assert result["retried"]["published"] and result["retried"]["publish/retried_tensors"] == 1
    assert result["v2"][0][0]["policy_version"] == 2
    assert DAMAGED in result["failure"] and "twice" in result["failure"]
