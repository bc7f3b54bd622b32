from __future__ import annotations

import random

import numpy as np
import torch

from hybridrl.store.checkpoints import CheckpointManager, capture_rng, restore_rng


def test_save_latest_prune_and_ignore_incomplete(tmp_path):
    mgr = CheckpointManager(tmp_path, keep=2)
    assert mgr.latest() is None
    for step in (2, 4, 6):
        mgr.save(step, {"policy_version": step}, lambda d: (d / "weights.bin").write_bytes(b"x"))
    assert [p.name for p in mgr.complete()] == ["step_000004", "step_000006"]
    # a save killed before COMPLETE is not a checkpoint
    broken = mgr.path(8)
    (broken / "model").mkdir(parents=True)
    assert mgr.latest().name == "step_000006"
    assert CheckpointManager.load_state(mgr.latest())["policy_version"] == 6
    try:
        CheckpointManager.load_state(broken)
        raise AssertionError("an incomplete checkpoint was loaded")
    except FileNotFoundError as err:
        assert "COMPLETE" in str(err)


def test_rng_roundtrip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
