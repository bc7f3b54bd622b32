"""LoRA on the Megatron actor, with real ranks (one 2-rank launch, `lora_jobs.layouts`): TP=2 equals
TP=1 (logprobs with adapters, the step's new adapters); the adapters are exactly PEFT's on the HF
model (per projection of the fused QKV and gate-up); only the adapters train (by accounting); the
reference is the base with adapters off; the PEFT and merged exports load in peft/transformers and
give the trainer's logits."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.backends.megatron.lora import peft_config, peft_tensors
from tests.backends.megatron.lora_jobs import ALPHA, RANK, TEMPERATURE
from tests.backends.megatron.reference import hf_logits, token_logprobs
from tests.launch import run_torchrun

TOL = 1e-5


@pytest.fixture(scope="module")
def job(tmp_path_factory, qwen2_dir):
    out = tmp_path_factory.mktemp("lora")
    proc = run_torchrun(["--standalone", "--nproc-per-node=2", "-m", "tests.backends.megatron.lora_jobs", "layouts",
                         str(out), str(qwen2_dir)], timeout=600, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    records = json.loads((out / "layouts.json").read_text())
    return out, records, {name: torch.load(out / f"{name}.pt") for name in ("tp1", "tp2")}


def test_tp2_equals_tp1_with_adapters(job):
    _, records, runs = job
    assert (runs["tp2"]["logprobs"] - runs["tp1"]["logprobs"]).abs().max() < TOL
    # the adapters matter (so the equality above is not the base's)
    assert (runs["tp2"]["logprobs"] - runs["tp2"]["ref_logprobs"]).abs().max() > 1e-2
    tp2, tp1 = records["tp2"][0], records["tp1"][0]
    assert abs(tp2["loss"] - tp1["loss"]) < TOL and abs(tp2["grad_norm"] - tp1["grad_norm"]) < 1e-4 * tp1["grad_norm"]
    # one optimizer step moves the adapters the same way under both layouts
    moved = 0.0
    for name, (a1, b1) in runs["tp1"]["factors"].items():
        a2, b2 = runs["tp2"]["factors"][name]
        assert torch.allclose(a1, a2, atol=TOL) and torch.allclose(b1, b2, atol=TOL), name
        moved = max(moved, float((b1 - torch.load(job[0] / "seeded.pt")[name][1]).abs().max()))
    assert moved > 1e-4


def test_adapters_are_pefts_on_the_hf_model(job, qwen2_dir, hf_model, tmp_path):
    """The seeded adapters loaded into peft on the HF base give the trainer's logprobs."""
    from peft import PeftModel
    from safetensors.torch import save_file

    out, _, runs = job
    seeded = torch.load(out / "seeded.pt")
    save_file(peft_tensors(seeded), str(tmp_path / "adapter_model.safetensors"))
    cfg = peft_config(type("C", (), {"rank": RANK, "alpha": ALPHA, "dropout": 0.0,
                                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]})(), str(qwen2_dir))
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(qwen2_dir, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path).eval()
    batch = torch.load(out / "tp2_logits.pt")["batch"]
    from hybridrl.data.batch import Batch

    logits = hf_logits(peft_model, Batch(batch))
    lp, _ = token_logprobs(logits, batch["input_ids"], batch["attention_mask"], TEMPERATURE)
    for layout in ("tp1", "tp2"):     # TP=1: two KV groups on a rank, TP=2: one
        assert (lp - runs[layout]["logprobs"]).abs().max() < 1e-4, layout
    # and the reference (adapters off) is the plain HF base
    base_logits = hf_logits(hf_model(qwen2_dir), Batch(batch))
    ref, _ = token_logprobs(base_logits, batch["input_ids"], batch["attention_mask"], TEMPERATURE)
    assert (ref - runs["tp2"]["ref_logprobs"]).abs().max() < 1e-4


def test_only_the_adapters_train(job):
    _, records, _ = job
    for layout, world in (("tp2", 1), ("tp1", 2)):     # data-parallel size
        for rec in records[layout]:
            assert rec["fresh_B_max"] == 0.0, "a fresh adapter starts at the base (B = 0)"
            assert rec["base_requires_grad"] == 0 and rec["base_with_grad"] == 0 and rec["base_changed"] == 0
            assert rec["trained"] == rec["adapters"] > 0 and rec["frozen"] > 5 * rec["adapters"]
            assert rec["grad_buffer_numel"] == rec["adapters"]
            # the (distributed) optimizer holds Adam's two moments for its share of the adapters, nothing else
            assert rec["optimizer_param_numel"] * world == rec["adapters"]
            assert rec["optimizer_state_numel"] == 2 * rec["optimizer_param_numel"]
            # the reference's forward is not counted as the actor's
            assert rec["passes_after_ref"]["logprobs"] == 1


def test_peft_and_merged_exports_give_the_trainers_logits(job):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridrl.data.batch import Batch

    out, _, _ = job
    saved = torch.load(out / "tp2_logits.pt")
    batch, logits = Batch(saved["batch"]), saved["logits"]
    config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32).eval()
    with_peft = hf_logits(PeftModel.from_pretrained(base, out / "peft").eval(), batch)
    mask = batch["attention_mask"].bool()
    assert (with_peft - logits)[mask].abs().max() < 1e-4
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    assert (hf_logits(merged, batch) - logits)[mask].abs().max() < 1e-4


def test_checkpoint_resumes_the_adapters_exactly(job):
    _, records, _ = job
    for rec in records["tp2"]:
        assert rec["second_step_moved"]
        assert rec["resumed_equal_before"] and rec["resumed_equal_after"]
