"""Which trajectories are admitted to an update, and why the others are not (each reason counted).

Applied in this order, so every rejected trajectory has exactly one reason:
  infra_invalid     status INFRA_INVALID: not the policy's fault, never trained on
  aborted           status ABORTED (cancelled mid-episode: a stop request, not the policy)
  truncated         status TRUNCATED (max turns, tokens or time), only with `drop_truncated`
  policy_lag        a policy token older than `current_version - max_policy_lag` (`over_lag`)
  all_equal_group   every admitted member of the group got the same reward (no signal for a
                    group baseline; "dynamic sampling"), when `drop_all_equal_groups`
                    (`informative_groups`). It reads the task reward, which is exactly what the
                    estimators' group statistics read: a KL penalty in the reward (algo.kl_in=reward)
                    is added per token outside them (`groups.token_returns`), so a dropped group
                    loses its KL term too, as it would with the KL in the loss (`config show
                    --explain` says so)

Truncated trajectories: a budget ran out because of what the policy did (it called tools until
max_turns, wrote until max_response_tokens, ran until max_episode_s). By default they stay in
their group with the reward they earned (an unfinished episode usually earns 0) and are trained,
so truncating is never a way out of a negative advantage. Dropping them (`drop_truncated`) takes
them out before the group statistics: a group with one success and seven truncations is then an
all-equal group of one. The optional soft overlong penalty (`overlong_penalty`, DAPO, Yu et al.,
2025) adds a reward component 'overlong' that grows linearly over the last `overlong_buffer`
tokens of the response budget; it is applied by `admit` before the filters, so a group that
differs only in length is not all-equal.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from hybridrl.data.trajectory import Trajectory, TrajectoryStatus, Truncation

REASONS = ("infra_invalid", "aborted", "truncated", "policy_lag", "all_equal_group")
OVERLONG = "overlong"
_BUDGET_ENDS = (Truncation.MAX_RESPONSE_TOKENS, Truncation.CONTEXT)


@dataclass
class FilterResult:
    kept: list[Trajectory]
    rejected: dict[str, list[Trajectory]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {r: len(self.rejected.get(r, [])) for r in REASONS}


def admit(trajectories: Sequence[Trajectory], cfg: Any, *, current_version: int | None,
          max_response_tokens: int) -> FilterResult:
    """A step's admission as `cfg` (an AlgoConfig) configures it: the overlong penalty on every scored
    trajectory (`overlong_penalty`), then `filter_trajectories`."""
    if cfg.overlong_buffer > 0:
        for t in trajectories:
            overlong_penalty(t, max_response_tokens=max_response_tokens, buffer=cfg.overlong_buffer,
                             penalty=cfg.overlong_penalty)
    return filter_trajectories(trajectories, drop_truncated=cfg.drop_truncated,
                               drop_all_equal_groups=cfg.drop_all_equal_groups, current_version=current_version,
                               max_policy_lag=cfg.max_policy_lag if cfg.max_policy_lag >= 0 else None)


def filter_trajectories(trajectories: Sequence[Trajectory], *, drop_truncated: bool = False,
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
        signal = informative_groups(survivors, reward_tol)
        kept = [t for t in survivors if t.group_id in signal]
        rejected["all_equal_group"] += [t for t in survivors if t.group_id not in signal]
    return FilterResult(kept, dict(rejected))


def informative_groups(trajectories: Iterable[Trajectory], tol: float = 1e-9) -> set[str]:
    """Groups whose members' rewards are not all equal (a group baseline gets a signal from them)."""
    rewards: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        rewards[t.group_id].append(t.reward)
    return {g for g, r in rewards.items() if max(r) - min(r) > tol}


def over_lag(t: Trajectory, version: int, max_lag: int) -> bool:
    """Whether `t` holds a policy token more than `max_lag` versions older than `version`."""
    return bool(t.versions) and min(t.versions) < version - max_lag


def stale_groups(trajectories: Iterable[Trajectory], version: int, max_lag: int) -> set[str]:
    """Groups holding a trajectory `over_lag`."""
    return {t.group_id for t in trajectories if over_lag(t, version, max_lag)}


def overlong_penalty(t: Trajectory, *, max_response_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment as reward component 'overlong' (added once): 0 up to
    max_response_tokens - buffer response tokens, then -penalty * (excess / buffer), and -penalty for
    a response the token budget or the context cut. Returns the component's value."""
    if t.status in (TrajectoryStatus.INFRA_INVALID, TrajectoryStatus.ABORTED) or OVERLONG in t.rewards:
        return t.rewards.get(OVERLONG, 0.0)
    excess = len(t.response_ids) - (max_response_tokens - buffer)
    share = 1.0 if t.truncation in _BUDGET_ENDS else min(1.0, max(0, excess) / buffer)
    value = -penalty * share
    t.rewards[OVERLONG] = value
    t.reward_evaluators[OVERLONG] = f"{OVERLONG}@1(buffer={buffer},max={max_response_tokens})"
    t.reward += value
    return value


def _single_reason(t: Trajectory, drop_truncated: bool, current_version: int | None,
                   max_policy_lag: int | None) -> str | None:
    if t.status == TrajectoryStatus.INFRA_INVALID:
        return "infra_invalid"
    if t.status == TrajectoryStatus.ABORTED:
        return "aborted"
    if drop_truncated and t.status == TrajectoryStatus.TRUNCATED:
        return "truncated"
    if max_policy_lag is not None and current_version is not None and over_lag(t, current_version, max_policy_lag):
        return "policy_lag"
    return None
