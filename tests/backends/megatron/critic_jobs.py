"""Multi-rank critic jobs, run as real ranks under torchrun (gloo):

    torchrun --nproc-per-node N -m tests.backends.megatron.critic_jobs JOB OUT_DIR MODEL_DIR

Each writes what it measured (JSON / .pt from rank 0) for the test to check; nothing is asserted here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrl.algo.value_loss import make_value_loss_fn
from hybridrl.backends.megatron import MegatronConfig
from hybridrl.backends.megatron.engine import MegatronEngine
from hybridrl.backends.megatron.parallel import destroy_model_parallel
from tests.backends.megatron.reference import sequence_batch


def values_and_training(out: Path, model_dir: str) -> None:
    """Values under TP1 and TP2 (same weights, a value head from the directory), then 5 value-loss
    steps on a fixed batch under each layout: the values, losses and final values are written."""
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    batch = sequence_batch(6, vocab=vocab, seed=3)
    g = torch.Generator().manual_seed(1)
    batch.set("returns", torch.randn(batch["input_ids"].shape, generator=g) * batch["loss_mask"])
    records = {}
    layouts = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)} if dist.get_world_size() == 2 else {"tp1": (1, 1)}
    for key, (tp, pp) in layouts.items():
        cfg = MegatronConfig(tp=tp, pp=pp, micro_batch_size=2, lr=1e-2, weight_decay=0.0,
                             use_distributed_optimizer=False)
        critic = MegatronEngine.from_hf(model_dir, cfg, head="value")
        first = critic.compute_values(batch)
        losses = []
        loss_fn = make_value_loss_fn(clip=0.0)
        for _ in range(5):
            batch.set("values", torch.zeros_like(batch["returns"]))   # (unused with clip 0)
            losses.append(critic.train_step(batch, loss_fn)["loss"])
        last = critic.compute_values(batch)
        # the output rank (last stage, TP rank 0) holds the values and the head: gather them on rank 0
        mine = None if first is None else {"first": first["values"], "last": last["values"],
                                            "head": critic.value_head()}
        held = [None] * dist.get_world_size()
        dist.all_gather_object(held, mine)
        if dist.get_rank() == 0:
            records[key] = {"losses": losses}
            torch.save(next(h for h in held if h is not None), out / f"critic_{key}.pt")
        del critic
        destroy_model_parallel()
    if dist.get_rank() == 0:
        torch.save(batch.tensors, out / "critic_batch.pt")
        (out / "critic.json").write_text(json.dumps(records))


JOBS = {"values": values_and_training}

def _main() -> None:
    job, out_dir, *args = sys.argv[1:]
    dist.init_process_group("gloo")
    try:
        JOBS[job](Path(out_dir), *args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(_main)
