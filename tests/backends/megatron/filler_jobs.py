"""One rank under torchrun (gloo): the routers' gradient from one micro-batch whose main loss is 0, run
as an expert-parallel filler and as a real micro-batch, with and without activation recomputation.

    torchrun --nproc-per-node 1 -m tests.backends.megatron.filler_jobs OUT_DIR MODEL_DIR

Nothing is asserted here: tests/backends/megatron/test_filler_aux.py reads OUT_DIR/filler.json."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrl.backends.megatron import MegatronConfig, MegatronEngine
from hybridrl.backends.megatron.parallel import destroy_model_parallel
from hybridrl.backends.megatron.schedule import MicroBatch, micro_batches, run_schedule
from hybridrl.data.batch import Batch
from tests.backends.megatron.reference import sequence_batch


def _zero_loss(mb, logits):
    return (logits.float() * 0.0).sum()


def _router_grad(engine, mb: MicroBatch) -> float:
    engine.model.train()
    with engine._scope():                                   # the engine's CPU scope, as train_step runs
        engine.ddp.zero_grad_buffer()
        run_schedule(engine.ddp, [mb], _zero_loss, forward_only=False, pp=1)
    return sum(float(p.main_grad.abs().sum()) for n, p in engine.model.named_parameters() if "router" in n)


def _filler_of(mb: MicroBatch, filler: bool) -> MicroBatch:
    """The first row's first token as one micro-batch (what `schedule._even_out` appends)."""
    one = {k: v[:1, :1] for k, v in mb.batch.tensors.items() if v.dim() >= 2}
    one["loss_mask"] = torch.zeros_like(one["loss_mask"])
    ids = mb.input_ids[:1, :1]
    return MicroBatch(Batch(one), ids, torch.zeros_like(ids), torch.zeros(1, 1, 1, 1, dtype=torch.bool),
                      mb.attention_mask[:1, :1], mb.rows[:1], filler=filler)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out, path = Path(sys.argv[1]), sys.argv[2]
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    results = {}
    for recompute in (False, True):
        destroy_model_parallel()
        engine = MegatronEngine.from_hf(path, MegatronConfig(micro_batch_size=2, moe_aux_loss_coef=0.5,
                                                             moe_z_loss_coef=0.1, recompute_activations=recompute),
                                        training=True)
        first = micro_batches(sequence_batch(2, vocab=vocab, seed=1), 2, torch.device("cpu"))[0]
        for filler in (True, False):
            results[f"recompute={recompute},filler={filler}"] = _router_grad(engine, _filler_of(first, filler))
    out.mkdir(parents=True, exist_ok=True)
    (out / "filler.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(main)
