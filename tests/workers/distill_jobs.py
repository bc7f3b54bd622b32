"""A controller for the distillation test (`test_distill_worker.py`): `TrainSide.update_policy` with a
teacher on real ranks, on a synthetic batch split over the data-parallel ranks; writes result.json."""

from __future__ import annotations

import torch

from hybridrl.algo.minibatches import lay_out, plan
from hybridrl.controller.placements import build_colocated
from hybridrl.jobs import Job
from hybridrl.workers.train_side import TrainSide
from tests.workers.hybrid_jobs import _ppo_batch, _write


def distill_update(cfg, wg):
    """One update (one mini-batch) of a batch whose groups straddle the ranks; the per-token values that come
    back are put in the batch's own row order."""
    batch = _ppo_batch(vocab=500)
    layout = plan(len(batch), wg.mesh("train").dp_size, 1)
    out = wg.call(TrainSide.update_policy, lay_out(batch, layout), mini_batch_rows=layout.rows_per_rank,
                  num_groups=int(batch["group_index"].max()) + 1, ppo_epochs=1)
    positions = torch.tensor(layout.real_positions, dtype=torch.long)
    rows = torch.empty(len(batch), dtype=torch.long)
    rows[torch.tensor([layout.order[p] for p in layout.real_positions], dtype=torch.long)] = positions
    _write(cfg, {"metrics": out.info["metrics"],
                 **{k: batch[k].tolist() for k in ("input_ids", "attention_mask", "loss_mask", "reward", "group_index")},
                 **{k: out[k][rows].tolist() for k in ("advantages", "old_logprobs", "teacher_logprobs")}})


DISTILL = Job("distill", build_colocated, distill_update)
