from __future__ import annotations

from hybridrl.algo.filters import filter_trajectories
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
    res = filter_trajectories(ts, current_version=5, max_policy_lag=2)
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
