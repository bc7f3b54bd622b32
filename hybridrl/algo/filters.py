"""Which trajectories are admitted to an update, and why the others are not (each reason counted).

Applied in this order, so every rejected trajectory has exactly one reason:
  infra_invalid     status INFRA_INVALID: not the policy's fault, never trained on
  aborted           status ABORTED (cancelled mid-episode)
  truncated         status TRUNCATED (overlong), when `drop_truncated`
  policy_lag        a policy token older than `current_version - max_policy_lag`
  all_equal_group   every admitted member of the group got the same reward (no signal for a
                    group baseline; "dynamic sampling"), when `drop_all_equal_groups`
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from hybridrl.data.trajectory import Trajectory, TrajectoryStatus

REASONS = ("infra_invalid", "aborted", "truncated", "policy_lag", "all_equal_group")


@dataclass
class FilterResult:
    kept: list[Trajectory]
    rejected: dict[str, list[Trajectory]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {r: len(self.rejected.get(r, [])) for r in REASONS}


def filter_trajectories(trajectories: Sequence[Trajectory], *, drop_truncated: bool = True,
                        drop_all_equal_groups: bool = True, current_version: int | None = None,
                        max_policy_lag: int | None = None, reward_tol: float = 1e-9) -> FilterResult:
    rejected: dict[str, list[Trajectory]] = defaultdict(list)
    survivors = []
    for t in trajectories:
        reason = _single_reason(t, drop_truncated, current_version, max_policy_lag)
        if reason:
            rejected[reason].append(t)
        else:
            survivors.append(t)
    kept = survivors
    if drop_all_equal_groups:
        flat = all_equal_groups(survivors, reward_tol)
        kept = [t for t in survivors if t.group_id not in flat]
        rejected["all_equal_group"] += [t for t in survivors if t.group_id in flat]
    return FilterResult(kept, dict(rejected))


def all_equal_groups(trajectories: Sequence[Trajectory], tol: float = 1e-9) -> set[str]:
    """Groups whose members all got the same reward (within `tol`): no signal for a group baseline."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        by_group[t.group_id].append(t.reward)
    return {g for g, rewards in by_group.items() if max(rewards) - min(rewards) <= tol}


def _single_reason(t: Trajectory, drop_truncated: bool, current_version: int | None,
                   max_policy_lag: int | None) -> str | None:
    if t.status == TrajectoryStatus.INFRA_INVALID:
        return "infra_invalid"
    if t.status == TrajectoryStatus.ABORTED:
        return "aborted"
    if drop_truncated and t.status == TrajectoryStatus.TRUNCATED:
        return "truncated"
    if max_policy_lag is not None and current_version is not None and lagging(t, current_version, max_policy_lag):
        return "policy_lag"
    return None


def lagging(t: Trajectory, current_version: int, max_policy_lag: int) -> bool:
    """A policy token of `t` is older than `current_version - max_policy_lag` (the lag bound's one test)."""
    return bool(t.versions) and min(t.versions) < current_version - max_policy_lag
