"""Multi-rank jobs for the LoRA tests, run as real ranks under torchrun (gloo):

    torchrun --nproc-per-node 2 -m tests.backends.megatron.lora_jobs JOB OUT_DIR MODEL_DIR

`layouts`: the same adapters (seeded, B non-zero) under TP=2 and TP=1 (x DP=2): logprobs with and
without adapters, the gradient step's new adapters, the accounting of what trains, and a PEFT +
merged HF export of the TP=2 actor after one step (with its logits, for the test to load with
peft). Nothing is asserted here: the test compares the numbers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrl.backends.megatron import MegatronConfig, MegatronEngine
from hybridrl.backends.megatron.config import LoraConfig
from hybridrl.backends.lora_names import projection_shapes
from hybridrl.backends.megatron.parallel import destroy_model_parallel
from hybridrl.backends.model_spec import ModelSpec
from tests.backends.megatron.reference import pg_loss, sequence_batch

RANK, ALPHA, LR = 4, 8.0, 1e-3
TEMPERATURE = 0.7


def seeded_factors(model_dir: str, targets: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Full HF factors with B != 0 (a fresh adapter's B is 0, which would hide a layout mistake)."""
    spec = ModelSpec.from_dir(Path(model_dir))
    gen = torch.Generator().manual_seed(7)
    out = {}
    for layer in range(spec.num_layers):
        for proj in targets:
            o, i = projection_shapes(spec)[proj]
            module = f"model.layers.{layer}.{'mlp' if proj in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{proj}"
            out[module] = (torch.randn(RANK, i, generator=gen) * 0.2, torch.randn(o, RANK, generator=gen) * 0.2)
    return out


def _accounting(engine) -> dict:
    from hybridrl.backends.megatron.lora import trainable_numel

    trained, frozen = trainable_numel(engine.model)
    adapters = sum(p.numel() for p in engine.model.lora.parameters())
    state = 0
    state_params = 0
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state_params += p.numel()
                state += sum(v.numel() for k, v in opt.optimizer.state[p].items() if torch.is_tensor(v) and v.dim())
    base = [p for n, p in engine.model.named_parameters() if not n.startswith("lora.")]
    return {"trained": trained, "frozen": frozen, "adapters": adapters, "optimizer_state_numel": state,
            "optimizer_param_numel": state_params,
            "grad_buffer_numel": sum(b.grad_data.numel() for b in engine.ddp.buffers),
            "base_with_grad": sum(1 for p in base if p.grad is not None or getattr(p, "main_grad", None) is not None),
            "base_requires_grad": sum(1 for p in base if p.requires_grad)}


def layouts(out: Path, model_dir: str) -> None:
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    factors = seeded_factors(model_dir, targets)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    batch = sequence_batch(4, vocab=vocab, seed=3)
    records = {}
    for name, tp in (("tp2", 2), ("tp1", 1)):
        destroy_model_parallel()
        cfg = MegatronConfig(tp=tp, micro_batch_size=2, lr=LR, weight_decay=0.0,
                             lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets))
        engine = MegatronEngine.from_hf(model_dir, cfg, training=True)
        base_before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not n.startswith("lora.")}
        fresh = engine.lora_factors()
        engine.load_lora_factors(factors)
        rec: dict = {"fresh_B_max": max(float(b.abs().max()) for _, b in fresh.values())}
        lp = engine.compute_logprobs(batch, temperature=TEMPERATURE)
        ref = engine.base_model().compute_logprobs(batch, temperature=TEMPERATURE)
        rec["passes_after_ref"] = dict(engine.passes)
        # the data-parallel ranks (TP=1) train on their half of the rows, as the dispatcher splits them
        rows = batch if tp == 2 else batch.slice(2 * dist.get_rank(), 2 * dist.get_rank() + 2)
        metrics = engine.train_step(rows, pg_loss, temperature=TEMPERATURE)
        rec["loss"], rec["grad_norm"] = metrics["loss"], metrics["grad_norm"]
        rec.update(_accounting(engine))
        rec["base_changed"] = sum(1 for n, p in engine.model.named_parameters()
                                  if not n.startswith("lora.") and not torch.equal(p.detach(), base_before[n]))
        stepped = engine.lora_factors()
        if name == "tp2":
            # resume: a checkpoint after the step, then the next step, against a fresh engine loaded from it
            engine.save_checkpoint(out / "ckpt")
            engine.train_step(rows, pg_loss, temperature=TEMPERATURE)
            after_two = engine.lora_factors()
            resumed = MegatronEngine.from_hf(model_dir, cfg, training=True)
            resumed.load_checkpoint(out / "ckpt")
            rec["resumed_equal_before"] = all(torch.equal(stepped[k][i], v[i])
                                              for k, v in resumed.lora_factors().items() for i in (0, 1))
            resumed.train_step(rows, pg_loss, temperature=TEMPERATURE)
            rec["resumed_equal_after"] = all(torch.equal(after_two[k][i], v[i])
                                             for k, v in resumed.lora_factors().items() for i in (0, 1))
            rec["second_step_moved"] = any(not torch.equal(after_two[k][1], stepped[k][1]) for k in stepped)
            engine.load_checkpoint(out / "ckpt")
            engine.export_peft(out / "peft")
            engine.export_hf(out / "merged")
            logits = engine.compute_logits(batch)
            if engine.is_output_rank:
                torch.save({"logits": logits, "batch": batch.tensors}, out / "tp2_logits.pt")
        if engine.is_output_rank and dist.get_rank() == 0:
            torch.save({"logprobs": lp["logprobs"], "ref_logprobs": ref["logprobs"], "factors": stepped},
                       out / f"{name}.pt")
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rec)
        records[name] = gathered
    if dist.get_rank() == 0:
        torch.save(factors, out / "seeded.pt")
        (out / "layouts.json").write_text(json.dumps(records, indent=1))


def _main() -> None:
    dist.init_process_group("gloo")
    try:
        {"layouts": layouts}[sys.argv[1]](Path(sys.argv[2]), *sys.argv[3:])
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(_main)
