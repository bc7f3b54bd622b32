"""PPO mini-batch layouts, and advantages that stay exact when a batch is split over real ranks."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.algo.minibatches import FILLER, lay_out, mini_batch_slices, plan
from hybridrl.data.batch import Batch
from tests.launch import run_torchrun


@pytest.mark.parametrize("n, dp, k", [(16, 2, 4), (13, 2, 4), (5, 4, 2), (3, 2, 8), (1, 3, 1), (29, 3, 5)])
def test_layout_gives_every_rank_its_part_of_the_same_global_mini_batches(n, dp, k):
    layout = plan(n, dp, k)
    per_rank = sum(layout.rows_per_rank)
    assert len(layout.order) == dp * per_rank                       # equal shares: no dispatcher padding
    shares = [layout.order[r * per_rank:(r + 1) * per_rank] for r in range(dp)]
    mini = [[src for share in shares for src in share[lo:hi] if src != FILLER]
            for lo, hi in mini_batch_slices(layout.rows_per_rank)]
    # the mini-batches do not depend on dp: consecutive, nearly equal, every row exactly once
    assert mini == [list(range(n * j // len(mini), n * (j + 1) // len(mini))) for j in range(len(mini))]
    assert len(mini) == min(k, n) and sorted(layout.order[p] for p in layout.real_positions) == list(range(n))
    assert mini == [m for m in (plan(n, 1, k).order[lo:hi] for lo, hi in mini_batch_slices(plan(n, 1, k).rows_per_rank))]


def test_filler_rows_carry_no_loss_no_reward_and_no_group():
    b = Batch({"loss_mask": torch.ones(3, 4), "reward": torch.ones(3), "group_index": torch.tensor([0, 0, 1]),
               "input_ids": torch.arange(12).view(3, 4)})
    layout = plan(3, 2, 1)                                           # 2 rows per rank: one filler
    out = lay_out(b, layout)
    filler = torch.tensor(layout.order) == FILLER
    assert int(filler.sum()) == 1
    assert out["loss_mask"][filler].sum() == 0 and out["reward"][filler].sum() == 0
    assert (out["group_index"][filler] == -1).all()
    assert torch.equal(out["input_ids"][~filler], b["input_ids"][torch.tensor(layout.order)[~filler]])


def test_advantages_over_two_real_ranks_equal_one_rank(tmp_path):
    """GRPO group stats, RLOO, REINFORCE++ (group baseline, global whitening, KL token rewards) with the
    batch split over 2 gloo ranks, groups straddling the split: the same advantages as one rank."""
    out = tmp_path / "adv.json"
    proc = run_torchrun(["--standalone", "--nproc-per-node=2", "-m", "tests.algo.dp_jobs", str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result) == 10
    for name, r in result.items():
        assert r["max_abs"] > 0.1, name                               # not a vacuous all-zero case
        assert r["max_diff"] < 1e-6, (name, r)
        assert r["filler_zero"], name
