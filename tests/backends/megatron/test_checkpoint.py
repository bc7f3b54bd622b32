"""Save -> kill -> load: a fresh process restores model, optimizer, LR schedule, RNG and the
caller's extra state, and its next step reproduces the uninterrupted run's loss exactly.
Layouts: DP=2 (the distributed optimizer really sharded) and PP=2 (tied embeddings on both stages)."""

from __future__ import annotations

import json

import pytest

from tests.backends.megatron.conftest import run_job
from tests.launch import processes_mentioning


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, qwen2_dir):
    out = tmp_path_factory.mktemp("ckpt")
    saved = run_job(2, "checkpoint", out, qwen2_dir, "save", expect_ok=False)
    assert saved.returncode != 0, "the save run should have been killed (SIGKILL) after saving"
    assert not processes_mentioning(str(out)), "the killed run left processes behind"
    before = [json.loads((out / f"save_rank{r}.json").read_text()) for r in range(2)]
    run_job(2, "checkpoint", out, qwen2_dir, "load")
    after = [json.loads((out / f"load_rank{r}.json").read_text()) for r in range(2)]
    return before, after


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_resume_reproduces_next_step_exactly(resumed, layout):
    before, after = resumed
    for b, a in zip(before, after):
        b, a = b[layout], a[layout]
        assert a["extra"] == {"data_cursor": 42, "policy_version": 3}
        assert a["num_steps"] == 2
        assert a["next"] == b["next"]                    # loss, grad norm, lr, metrics: bit for bit
        assert b["before"][-1] != b["next"]["loss"]      # training moved
