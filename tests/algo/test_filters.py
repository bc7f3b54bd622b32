from __future__ import annotations

import pytest
import torch

from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.filters import admit, filter_trajectories, informative_groups, over_lag, stale_groups
from hybridrl.algo.groups import group_index_of
from hybridrl.algo.objective import compute_advantages
from hybridrl.data.trajectory import to_batch
from hybridrl.data.trajectory import Trajectory, TrajectoryStatus, Truncation


def traj(group, attempt, reward, status=TrajectoryStatus.COMPLETED, version=5):
    t = Trajectory(run_id="r", task_id=group, group_id=group, attempt=attempt, prompt_ids=[1])
    t.append([2, 3], policy=True, logprobs=[-1.0, -1.0], version=version)
    t.reward = reward
    t.status = status
    if status == TrajectoryStatus.TRUNCATED:
        t.truncation = Truncation.MAX_RESPONSE_TOKENS
    return t


def test_each_rejection_has_one_counted_reason():
    ts = [
        traj("a", 0, 1.0), traj("a", 1, 0.0), traj("a", 2, 0.0, TrajectoryStatus.INFRA_INVALID),
        traj("b", 0, 1.0), traj("b", 1, 0.0, TrajectoryStatus.TRUNCATED),   # b becomes all-equal
        traj("c", 0, 0.0), traj("c", 1, 0.0),                                # all equal
        traj("d", 0, 1.0, version=1), traj("d", 1, 0.0), traj("d", 2, 1.0, TrajectoryStatus.ABORTED),
    ]
    res = filter_trajectories(ts, drop_truncated=True, current_version=5, max_policy_lag=2)
    assert res.counts == {"infra_invalid": 1, "aborted": 1, "truncated": 1, "policy_lag": 1,
                          "all_equal_group": 4}
    assert [(t.group_id, t.attempt) for t in res.kept] == [("a", 0), ("a", 1)]
    assert sum(res.counts.values()) + len(res.kept) == len(ts)


def test_switches():
    ts = [traj("a", 0, 1.0), traj("a", 1, 1.0), traj("b", 0, 0.0, TrajectoryStatus.TRUNCATED),
          traj("b", 1, 1.0)]
    res = filter_trajectories(ts, drop_truncated=False, drop_all_equal_groups=False)
    assert len(res.kept) == 4
    res = filter_trajectories([traj("x", 0, 1.0, TrajectoryStatus.INFRA_INVALID)], drop_truncated=False,
                              drop_all_equal_groups=False)
    assert res.kept == [] and res.counts["infra_invalid"] == 1    # never trained on, whatever the switches


def test_truncation_is_no_way_out_of_a_negative_advantage():
    """One success and seven truncations (the policy wrote until its budget ran out): by default the
    group is kept whole, the truncated members get their reward (0) and a negative advantage."""
    group = [traj("g", 0, 1.0)] + [traj("g", i, 0.0, TrajectoryStatus.TRUNCATED) for i in range(1, 8)]
    res = admit(group, AlgoConfig(), current_version=5, max_response_tokens=100)
    assert len(res.kept) == 8 and res.counts["truncated"] == 0
    batch = to_batch(res.kept)
    adv = compute_advantages(AlgoConfig(), batch["reward"], group_index_of(batch["group_id"]), batch["loss_mask"])
    per_row = adv.sum(dim=1)
    assert per_row[0] > 0 and (per_row[1:] < 0).all()
    dropped = admit(group, AlgoConfig(drop_truncated=True), current_version=5, max_response_tokens=100)
    assert dropped.kept == [] and dropped.counts == {"infra_invalid": 0, "aborted": 0, "truncated": 7,
                                                     "policy_lag": 0, "all_equal_group": 1}


def test_soft_overlong_penalty():
    def sized(n, attempt, status=TrajectoryStatus.COMPLETED):
        t = traj("o", attempt, 1.0, status)
        t.append([4] * (n - 2), policy=False)
        return t

    ts = [sized(10, 0), sized(90, 1), sized(95, 2), sized(100, 3, TrajectoryStatus.TRUNCATED), sized(12, 4)]
    ts[4].truncation = Truncation.MAX_TURNS           # truncated by turns, short: no length penalty
    ts[4].status = TrajectoryStatus.TRUNCATED
    cfg = AlgoConfig(overlong_buffer=20, overlong_penalty=0.5)
    res = admit(ts, cfg, current_version=5, max_response_tokens=100)
    # buffer starts at 80 tokens: 10 -> 0, 90 -> -0.25, 95 -> -0.375, cut by the token budget -> -0.5
    assert [t.rewards.get("overlong") for t in ts] == pytest.approx([0.0, -0.25, -0.375, -0.5, 0.0])
    assert [t.reward for t in ts] == pytest.approx([1.0, 0.75, 0.625, 0.5, 1.0])
    assert ts[1].reward_evaluators["overlong"].startswith("overlong@1") and len(res.kept) == 5
    admit(ts, cfg, current_version=5, max_response_tokens=100)     # applied once
    assert ts[1].reward == pytest.approx(0.75)
    off = admit([sized(90, 0)], AlgoConfig(drop_all_equal_groups=False), current_version=5, max_response_tokens=100)
    assert off.kept[0].rewards == {}                                # off by default


def test_group_and_lag_tests_are_exported_once():
    ts = [traj("a", 0, 1.0), traj("a", 1, 1.0), traj("b", 0, 0.0, version=2), traj("b", 1, 1.0)]
    assert informative_groups(ts) == {"b"}
    assert stale_groups(ts, version=5, max_lag=2) == {"b"} and stale_groups(ts, version=5, max_lag=3) == set()
    assert over_lag(ts[2], 5, 2) and not over_lag(ts[0], 5, 0)
