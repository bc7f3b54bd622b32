"""Save -> kill -> load: a fresh process restores model, optimizer, LR schedule, RNG and the
caller's extra state, and its next step reproduces the uninterrupted run's loss exactly. A
checkpoint taken before the first optimizer step (an RL run whose first steps admit nothing)
saves and resumes like any other.
Layouts: DP=2 (the distributed optimizer really sharded) and PP=2 (tied embeddings on both stages);
the DP=2 checkpoint also resumes on one rank."""

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
    before = [json.loads((out / f"save_w2_rank{r}.json").read_text()) for r in range(2)]
    run_job(2, "checkpoint", out, qwen2_dir, "load")
    after = [json.loads((out / f"load_w2_rank{r}.json").read_text()) for r in range(2)]
    run_job(1, "checkpoint", out, qwen2_dir, "load")
    fewer_ranks = json.loads((out / "load_w1_rank0.json").read_text())
    return before, after, fewer_ranks


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_resume_reproduces_next_step_exactly(resumed, layout):
    before, after, _ = resumed
    for b, a in zip(before, after):
        b, a = b[layout], a[layout]
        assert a["extra"] == {"data_cursor": 42, "policy_version": 3}
        assert a["num_steps"] == 2
        assert a["next"] == b["next"]                    # loss, grad norm, lr, metrics: bit for bit
        assert a["draws"] == b["draws"]                  # each rank's own Python / numpy / torch generators
        assert b["before"][-1] != b["next"]["loss"]      # training moved
    assert before[0][layout]["draws"] != before[1][layout]["draws"]      # the ranks' streams differ


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_a_checkpoint_before_the_first_step_resumes_to_the_same_numbers(resumed, layout):
    before, after, _ = resumed
    for b, a in zip(before, after):
        b, a = b[layout], a[layout]
        assert a["step0_extra"] == {"policy_version": 0}
        assert a["from_step0"] == a["never_saved"]              # loaded step-0 state == a fresh optimizer
        assert [s["loss"] for s in a["from_step0"]] == [*b["before"], b["next"]["loss"]]   # saving changed nothing
        assert a["from_step0"][0]["loss"] != a["from_step0"][2]["loss"]                  # and training moved


def test_resume_at_a_smaller_data_parallel_size(resumed):
    """Saved at DP=2 (optimizer state sharded two ways), resumed on one rank with the whole batch."""
    before, _, fewer = resumed
    got, want = fewer["dp2"], before[0]["dp2"]
    assert got["extra"] == {"data_cursor": 42, "policy_version": 3} and got["num_steps"] == 2
    assert abs(got["next"]["loss"] - want["next"]["loss"]) < 1e-5
    assert abs(got["next"]["grad_norm"] - want["next"]["grad_norm"]) < 1e-5 * want["next"]["grad_norm"]
