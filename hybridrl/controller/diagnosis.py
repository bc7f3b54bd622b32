"""Why a run learns nothing, from what each step counted: a "dead run" diagnosis.

A step gives the policy no learning signal when no group it admitted has members with different
rewards (with a group baseline, GRPO / RLOO / REINFORCE++, every advantage is then zero), or, with
a critic (GAE), when every admitted episode got the same reward. From `DEAD_STEPS` such steps in a
row the run says once why, from the steps' counts (filter reasons, successes), and what to change:

    infra_invalid   most episodes failed in the infrastructure (engine, tool or reward errors)
    truncated       most episodes were cut off and dropped
    never           no sample succeeded: the policy never solves the task
    always          every sample succeeded: nothing left to learn
    equal_groups    some samples succeed, but never some of a group and not the others

`trainer.stop_after_dead_steps=N` ends the run after N such steps in a row. Import-light: `hybridrl
inspect` diagnoses a run directory from its metrics.jsonl the same way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterable

DEAD_STEPS = 3          # steps in a row without a signal before the run says why


@dataclass(frozen=True)
class Diagnosis:
    first_step: int
    last_step: int
    episodes: int
    cause: str
    text: str           # one line: what was counted, then what to change

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1


def is_dead(row: dict, *, group_baseline: bool = True) -> bool | None:
    """Whether a step's metrics show no learning signal (None: the row does not say)."""
    if group_baseline:
        informative = row.get("groups/informative")
        return None if informative is None else informative == 0
    std = row.get("reward/admitted_std")
    return None if std is None else std == 0


def dead_streak(rows: Iterable[dict], *, group_baseline: bool = True) -> list[dict]:
    """The steps without a signal at the end of `rows` (training steps, in order)."""
    streak: list[dict] = []
    for row in rows:
        if row.get("step", 0) <= 0:
            continue
        streak = streak + [row] if is_dead(row, group_baseline=group_baseline) else []
    return streak


def diagnose(rows: Iterable[dict], *, group_baseline: bool = True, min_steps: int = DEAD_STEPS) -> Diagnosis | None:
    """The diagnosis of the newest run of at least `min_steps` dead steps in `rows`, else None."""
    found, streak = None, []
    for row in rows:
        if row.get("step", 0) <= 0:
            continue
        if is_dead(row, group_baseline=group_baseline):
            streak.append(row)
            continue
        if len(streak) >= min_steps:
            found = streak
        streak = []
    if len(streak) >= min_steps:
        found = streak
    return explain(found) if found else None


def explain(streak: list[dict]) -> Diagnosis:
    """One line for a run of dead steps: what was counted in them, and what to change."""
    first, last = int(streak[0]["step"]), int(streak[-1]["step"])
    total = lambda key: int(sum(r.get(key) or 0 for r in streak))  # noqa: E731
    episodes = total("episodes")
    succeeded, infra, truncated = total("episodes/succeeded"), total("filter/infra_invalid"), total("filter/truncated")
    agent_errors = total("episodes/agent_errors")
    where = f"no learning signal in step {first}" if first == last else f"no learning signal in steps {first}-{last}"
    if agent_errors * 2 >= episodes:
        cause, what = "agent_errors", (
            f"{agent_errors} of {episodes} episodes ended in an agent error (the agent's own code raised, or asked "
            "the model nothing; the first traceback is in the log above) — fix the agent, see `hybridrl inspect "
            "RUN_DIR --failed` for each episode's error")
    elif infra * 2 >= episodes:
        cause, what = "infra_invalid", (
            f"{infra} of {episodes} episodes were infrastructure-invalid (engine, tool or reward failures, "
            "filter/infra_invalid) — see `hybridrl inspect RUN_DIR --failed` for the reasons")
    elif truncated * 2 >= episodes:
        cause, what = "truncated", (
            f"{truncated} of {episodes} episodes were cut off and dropped (filter/truncated) — raise "
            "agent.max_response_tokens (or agent.max_turns), or train on them with algo.drop_truncated=false")
    elif succeeded == 0:
        cause, what = "never", (
            f"no sample succeeded in {episodes} episodes: the policy never solves the task — warm start longer "
            "(sft.steps), raise task.sft_tool_use_fraction, add a format reward (task.format_weight), or turn on "
            "trainer.dynamic_sampling")
    elif succeeded >= episodes:
        cause, what = "always", (
            f"every sample already succeeds ({succeeded} of {episodes} episodes): nothing left to learn — harder "
            "instances (task.options), or RL from a model that solves fewer")
    else:
        cause, what = "equal_groups", (
            f"{succeeded} of {episodes} episodes succeeded, but every group's samples scored alike — more samples "
            "per prompt (trainer.group_size), a higher agent.temperature, or trainer.dynamic_sampling")
    return Diagnosis(first, last, episodes, cause, f"{where}: {what}")


def all_failed(row: dict) -> bool:
    """Every episode of the step failed for a reason outside the policy's answer: an agent error (the user's
    agent code) or an infrastructure fault. Nothing of such a step can train."""
    episodes = row.get("episodes") or 0
    failed = (row.get("episodes/agent_errors") or 0) + (row.get("status/infra_invalid") or 0)
    return episodes > 0 and failed >= episodes


class SignalWatch:
    """A run observer (see `controller/callbacks.py`): says once why the run learns nothing, asks the run
    to stop after `stop_after` dead steps in a row (0: never), and says the run has failed (`fail_reason`:
    it ends with a non-zero exit) after `fail_after` steps in a row whose every episode failed (0: never)."""

    def __init__(self, *, group_baseline: bool, total_steps: int, stop_after: int = 0, fail_after: int = 0,
                 say: Callable[[str], None] | None = None):
        self.group_baseline, self.stop_after, self.fail_after = group_baseline, stop_after, fail_after
        self.failed_streak = 0
        self.fail_reason: str | None = None
        self.warn_after = min(DEAD_STEPS, total_steps)        # a shorter run says it at its end
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.rows: list[dict] = []
        self.said: Diagnosis | None = None
        self.stop_reason: str | None = None

    def on_start(self, run: dict) -> None:
        self.rows = [r for r in run.get("earlier_metrics", []) if r.get("step", 0) > 0]

    def on_step(self, step: int, metrics: dict) -> None:
        self.rows.append({"step": step, **metrics})
        self.failed_streak = self.failed_streak + 1 if all_failed(metrics) else 0
        if self.fail_after and self.failed_streak >= self.fail_after:
            self.fail_reason = (f"every episode of the last {self.failed_streak} steps failed "
                                f"(trainer.stop_after_failed_steps={self.fail_after}): "
                                f"{explain(self.rows[-self.failed_streak:]).text}")
        streak = dead_streak(self.rows, group_baseline=self.group_baseline)
        if not streak:
            return
        if self.said is None and len(streak) >= self.warn_after:
            self.said = explain(streak)
            self.say(f"rl: {self.said.text}")
        if self.stop_after and len(streak) >= self.stop_after:
            self.stop_reason = (f"{len(streak)} steps in a row without a learning signal "
                                f"(trainer.stop_after_dead_steps={self.stop_after}): {explain(streak).text}")
