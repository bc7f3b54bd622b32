"""Megatron on Qwen3, Qwen3-MoE and llama3-scaled Llama built with transformers alone, real ranks
(one torchrun launch for all of it, see family_jobs.py):

- logits, logprobs and entropy equal transformers at TP=2, PP=2 and DP=2, and for the MoE model at
  EP=2 (padded and packed micro-batches); HF -> Megatron -> HF bitwise; publication groups write
  exactly the checkpoint and keep each expert whole;
- one training step equals transformers + AdamW (TP=2, PP=2, EP=2, with the load-balancing loss);
- routing replay on rollouts of the native engine in bfloat16: with replay the trainer uses exactly
  the recorded experts (agreement 1, logprobs equal transformers forced to those experts) and is
  closer to the behaviour logprobs than without; without it the agreement is reported and below 1.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.rollout.protocol import SamplingParams
from tests.backends.families import FAMILIES
from tests.launch import run_torchrun

pytestmark = pytest.mark.timeout(900)


def _rollouts(path, out) -> str:
    """12 sampled episodes of the native engine in bfloat16 (the usual rollout precision), as a batch
    with the engine's routing record and behaviour logprobs (the trainer runs in float32)."""
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig
    from hybridrl.data.trajectory import Trajectory, to_batch
    from tests.backends.native.conftest import generate_all, prompts_of

    engine = NativeEngine.from_pretrained(path, NativeEngineConfig(kv_cache_mb=8, dtype="bfloat16"))
    try:
        prompts = prompts_of([6, 11, 17, 9] * 3, vocab=300, seed=5)
        outs = generate_all(engine, prompts, [SamplingParams(max_new_tokens=16, temperature=1.0, seed=i)
                                              for i in range(len(prompts))])
    finally:
        engine.close()
    trajectories = []
    for i, (prompt, o) in enumerate(zip(prompts, outs)):
        t = Trajectory(run_id="r", task_id="t", group_id=f"g{i // 4}", attempt=i % 4, prompt_ids=prompt)
        t.append(o.token_ids, policy=True, logprobs=o.logprobs, version=0, routed_experts=o.routed_experts)
        trajectories.append(t)
    batch = to_batch(trajectories)
    path = out / "rollouts.pt"
    torch.save({k: v for k, v in batch.tensors.items() if k in ("input_ids", "attention_mask", "loss_mask",
                                                                "behavior_logprobs", "routed_experts")}, path)
    return str(path)


def _launch(out, family_models, scope: str) -> dict:
    dirs = [str(family_models(f)) for f in FAMILIES]
    moe_dir = str(family_models("qwen3_moe"))
    rollouts = _rollouts(moe_dir, out)
    proc = run_torchrun(["--standalone", "--nproc-per-node=2", "-m", "tests.backends.megatron.family_jobs", str(out),
                         "parity,train,replay", f"scope={scope}", "parity=" + ",".join(dirs), "train=" + ",".join(dirs),
                         f"replay={moe_dir},{rollouts}"], timeout=1500, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ("parity", "train", "replay")}


@pytest.fixture(scope="module")
def results(tmp_path_factory, family_models):
    return _launch(tmp_path_factory.mktemp("families"), family_models, "quick")


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_equal_transformers_under_every_layout(results, family):
    check_parity(results["parity"][family], family)


def check_parity(layouts: dict, family: str) -> None:
    assert set(layouts) >= ({"ep2", "pp2"} if family == "qwen3_moe" else {"tp2", "pp2"})
    for name, ranks in layouts.items():
        outputs = [r for r in ranks if r["is_output_rank"]]
        assert len(outputs) == (2 if name.startswith(("tp1", "ep2")) else 1), name      # dp=2 there
        for r in outputs:
            assert r["logits_max_abs"] > 1.0, (name, r)                                  # not flat
            assert r["logits_diff"] < 1e-4 and r["logprobs_diff"] < 1e-4 and r["entropy_diff"] < 1e-4, (name, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_round_trip_is_bitwise_and_publication_groups_are_the_checkpoint(results, family):
    check_round_trip(results["parity"][family])


def check_round_trip(layouts: dict) -> None:
    for name, ranks in layouts.items():
        for r in ranks:
            assert r["same_names"] and r["bitwise"], (name, r)
            assert r["groups_equal_checkpoint"] and r["groups_cover"] and r["experts_whole"], (name, r)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_equals_transformers(results, family):
    check_train(results["train"][family], family)


def check_train(variants: dict, family: str) -> None:
    for name, ranks in variants.items():
        for r in ranks:
            # lr 1e-4: Adam turns rounding noise in a near-zero gradient element into a step of up to
            # ~lr; everything else agrees to ~1e-6
            assert r["max_diff"] < 5e-5, (name, r["worst"], r["max_diff"])
            if "aux_effect" in r:              # the load-balancing loss moved the weights, as transformers'
                assert r["aux_effect"] > 10 * r["max_diff"], (name, r)
        if family == "qwen3_moe":
            metrics = ranks[0]["metrics"]
            assert metrics["moe/aux_loss"] > 1.0                      # E * sum f P >= 1, = 1 when balanced
            assert all(metrics[f"moe/load_imbalance/layer_{i}"] >= 1.0 for i in (0, 2))


def test_replay_uses_exactly_the_recorded_experts(results):
    check_replay(results["replay"])


def check_replay(replay: dict) -> None:
    for name in [k for k in replay if k != "recompute"]:
        for r in replay[name]:
            on, off = r["rollout"], r["off"]
            assert on["moe/replay_agreement"] == 1.0 and on["moe/recorded_fraction"] > 0.9, (name, on)
            assert off["moe/replay_agreement"] == off["moe/router_agreement"], (name, off)
            assert 0.5 < off["moe/router_agreement"] < 1.0, (name, off)       # bf16 rollout: some flips
            if "mismatch_mean_abs" in on:
                assert r["forced_routing_diff"] < 1e-4, (name, r)
                assert on["mismatch_mean_abs"] < off["mismatch_mean_abs"], (name, on, off)


def test_replay_survives_activation_recomputation(results):
    for r in results["replay"]["recompute"]:
        (plain, recomputed) = r["losses"]
        assert max(abs(a - b) for a, b in zip(plain, recomputed)) < 1e-6, r
        assert r["weights_diff"] < 1e-6, r
        assert r["replay_metrics"]["moe/replay_agreement"] == 1.0


@pytest.mark.slow
def test_every_layout_and_variant(tmp_path, family_models):
    """The full scope: DP=2 for every family, the MoE model at TP=2 (scoring) and packed, the
    training variants at EP=2 without and PP=2 with the aux loss, replay under PP=2 and packed."""
    full = _launch(tmp_path, family_models, "full")
    for family in FAMILIES:
        check_parity(full["parity"][family], family)
        check_round_trip(full["parity"][family])
        check_train(full["train"][family], family)
    assert {"tp1", "tp2", "ep2-packed"} <= set(full["parity"]["qwen3_moe"])
    assert {"pp2", "ep2-packed"} <= set(full["replay"])
    check_replay(full["replay"])


@pytest.mark.slow
def test_moe_checkpoint_under_expert_parallelism_resumes_exactly(tmp_path, family_models):
    """Saved at EP=2 (each rank holds half the experts and their optimizer state), the job SIGKILLed,
    a fresh job loads it: its next step (loss, grad norm, MoE metrics) equals the uninterrupted one."""
    path = str(family_models("qwen3_moe"))
    args = ["--standalone", "--nproc-per-node=2", "-m", "tests.backends.megatron.family_jobs", str(tmp_path),
            "checkpoint"]
    saved = run_torchrun(args + [f"checkpoint={path},save"], timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert saved.returncode != 0, "the save run should have been killed (SIGKILL) after saving"
    loaded = run_torchrun(args + [f"checkpoint={path},load"], timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert loaded.returncode == 0, loaded.stderr[-6000:]
    for rank in range(2):
        before = json.loads((tmp_path / f"ckpt_save_rank{rank}.json").read_text())
        after = json.loads((tmp_path / f"ckpt_load_rank{rank}.json").read_text())
        assert after["extra"] == {"policy_version": 2}
        assert after["next"] == before["next"]                     # bit for bit
        assert before["before"][-1] != before["next"]["loss"]


LAYOUTS = {"qwen3": [("--tp", 2), ("--pp", 2)], "llama3": [("--tp", 2), ("--pp", 2)],
           "qwen3_moe": [("--ep", 2), ("--pp", 2)]}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_score_cli_equals_transformers(tmp_path, family_models, family):
    """`hybridrl score`, the command a user runs, at TP=2 and PP=2 (EP=2 for the MoE model)."""
    import subprocess
    import sys

    from tests.backends.families import load
    from tests.backends.megatron.reference import hf_logits, sequence_batch, token_logprobs
    from tests.launch import ROOT, env_with_repo

    from transformers import PreTrainedTokenizerFast

    from hybridrl.assets.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    model_dir = family_models(family)
    model = load(model_dir)
    path = tmp_path / "model"              # the family's model with a tokenizer (the command loads one)
    path.mkdir()
    for f in model_dir.iterdir():
        (path / f.name).symlink_to(f)
    PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size=model.config.vocab_size, num_documents=500),
                            eos_token=EOS_TOKEN, pad_token=PAD_TOKEN).save_pretrained(path)
    batch = sequence_batch(5, vocab=model.config.vocab_size, seed=11)
    lengths = batch["attention_mask"].sum(1).tolist()
    seqs = tmp_path / "seqs.jsonl"
    seqs.write_text("".join(json.dumps({"id": f"s{i}", "token_ids": batch["input_ids"][i, :n].tolist()}) + "\n"
                            for i, n in enumerate(lengths)))
    ref, _ = token_logprobs(hf_logits(model, batch), batch["input_ids"], batch["attention_mask"])
    for flag, size in LAYOUTS[family]:
        out = tmp_path / f"out{flag}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "hybridrl", "score", "--model", str(path), flag, str(size),
                               "--nproc", "2", "--input", str(seqs), "--output", str(out), "--batch-size", "2"],
                              cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        for i, line in enumerate(out.read_text().splitlines()):
            rec, n = json.loads(line), lengths[i]
            assert rec["id"] == f"s{i}" and len(rec["logprobs"]) == n and rec["logprobs"][0] is None
            assert max(abs(a - b) for a, b in zip(rec["logprobs"][1:], ref[i, 1:n].tolist())) < 1e-4, (flag, i)
