"""The train stream: distinct items within a call across epoch boundaries, every epoch a permutation,
resume from the cursor to the same order, and the run ledger no longer meets a repeated trajectory."""

from __future__ import annotations

import random
import sqlite3

import pytest

from hybridrl.controller.metrics import episode_rows
from hybridrl.data.stream import Cursor, ShuffledStream
from hybridrl.data.trajectory import Trajectory, TrajectoryStatus
from hybridrl.envs.tasks import TaskInstance


def instances(n: int) -> list[TaskInstance]:
    return [TaskInstance(task="calculator", task_id=f"q{i}", messages=({"role": "user", "content": f"{i}?"},),
                         reference=str(i)) for i in range(n)]


@pytest.mark.parametrize("size, per_call", [(100, 16), (20, 8), (7, 7), (10, 3), (5, 1)])
def test_a_call_never_repeats_an_item_and_every_epoch_is_a_permutation(size, per_call):
    stream = ShuffledStream(list(range(size)), seed=1)
    drawn = []
    for _ in range(2400 // per_call):
        got = stream.next(per_call)
        assert len(set(got)) == len(got) == per_call, got
        drawn += got
    for start in range(0, len(drawn) - size + 1, size):
        assert sorted(drawn[start:start + size]) == list(range(size))      # epoch e = items e*size .. (e+1)*size


def test_varying_call_sizes_and_calls_longer_than_the_split():
    rng = random.Random(0)
    stream = ShuffledStream(list(range(13)), seed=2)
    drawn = []
    for _ in range(300):
        n = rng.randint(1, 13)
        got = stream.next(n)
        assert len(set(got)) == n
        drawn += got
    for start in range(0, len(drawn) - 13 + 1, 13):
        assert sorted(drawn[start:start + 13]) == list(range(13))
    assert len(stream.next(30)) == 30                       # more than the split: repeats, no hang


def test_resume_from_the_cursor_continues_the_same_order():
    a = ShuffledStream(list(range(20)), seed=3)
    for _ in range(7):
        a.next(8)                                             # several mid-call epoch crossings
    state = a.state()
    b = ShuffledStream(list(range(20)), seed=3, cursor=Cursor(**state))
    assert [a.next(8) for _ in range(20)] == [b.next(8) for _ in range(20)]
    old = ShuffledStream(list(range(20)), seed=3, cursor=Cursor(epoch=1, position=4))    # a checkpoint before
    assert old.next(3) == ShuffledStream(list(range(20)), seed=3, cursor=Cursor(1, 4, ())).next(3)


def test_no_merged_group_reaches_the_ledger_at_an_epoch_end(tmp_path):
    """What stopped `hybridrl train ... task.train_size=20 trainer.prompts_per_step=8` at the first epoch
    boundary: one prompt drawn twice in a step is one group id with repeated trajectory ids, and the run
    ledger's UNIQUE constraint on trajectories.id."""
    from hybridrl.algo.config import AlgoConfig
    from hybridrl.algo.filters import filter_trajectories
    from hybridrl.store.config import StoreConfig
    from hybridrl.store.ledger import Ledger

    stream = ShuffledStream(instances(20), seed=0)
    ledger = Ledger(tmp_path, StoreConfig(), algo=AlgoConfig())
    for step in range(1, 8):
        rows = episode_rows(stream.next(8), 2, step)
        trajectories = []
        for inst, attempt, group in zip(rows["instance"], rows["attempt"], rows["group_id"]):
            t = Trajectory(run_id="r", task_id=inst["task_id"], group_id=group, attempt=attempt, prompt_ids=[1])
            t.append([2, 3], policy=True, logprobs=[-1.0, -1.0], version=step - 1)
            t.status, t.reward = TrajectoryStatus.COMPLETED, float(attempt)
            trajectories.append(t)
        groups = {}
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t)
        assert all(len(members) == 2 for members in groups.values())       # one group per prompt, never merged
        kept = filter_trajectories(trajectories, drop_all_equal_groups=False)
        try:
            ledger.record_step(step, trajectories=trajectories, kept=kept, batch=None, switch=None,
                               rollout_version=step - 1, version_after=step, metrics={})
        except sqlite3.IntegrityError as err:                              # pragma: no cover - the bug
            pytest.fail(f"step {step}: {err}")
