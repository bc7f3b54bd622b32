"""A mixture of tasks trained together (`task.name=mixture`, `task.mixture=[...]`).

Each entry is a task of its own (its options, seed, split sizes, format weight, and episode budgets),
and the mixture dispatches by the instance's task: `for_instance(instance)` is the task that made it,
so the agent loop parses, scores and builds environments with that task (and runs its episodes under
its budgets). Its splits are its tasks' splits side by side (`train_split(n)`: n of each task). Which
prompt is trained on next, each task's share and the difficulty sampler are the training stream's
(`hybridrl/data/mixture.py`).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task
from hybridrl.envs.tasks.registry import get_task, register_task
from hybridrl.reward.base import RewardResult


def entry_config(cfg: Any, entry: Any) -> Any:
    """The TaskConfig of one entry: the mixture's section, with the entry's own values where it sets them."""
    return dataclasses.replace(
        cfg, name=entry.name, mixture=[], options=dict(entry.options),
        seed=cfg.seed if entry.seed < 0 else entry.seed,
        train_size=entry.train_size or cfg.train_size, validation_size=entry.validation_size or cfg.validation_size,
        format_weight=cfg.format_weight if entry.format_weight < 0 else entry.format_weight)


@register_task
class MixtureTask(Task):
    name = "mixture"
    version = 1

    def __init__(self, cfg):
        self.cfg, self.options = cfg, None
        self.tasks: dict[str, Task] = {}
        self.weights: dict[str, float] = {}
        for entry in cfg.mixture:
            task = get_task(entry.name, entry_config(cfg, entry))
            task.budgets = dict(entry.budgets)
            self.tasks[task.name] = task
            self.weights[task.name] = float(entry.weight)
        self.action_formats = tuple(dict.fromkeys(f for t in self.tasks.values() for f in t.action_formats))

    def for_instance(self, instance: TaskInstance) -> Task:
        try:
            return self.tasks[instance.task]
        except KeyError:
            raise KeyError(f"instance {instance.task_id} is of task {instance.task!r}, which is not in the mixture "
                           f"({', '.join(self.tasks)})") from None

    def task_names(self) -> list[str]:
        return list(self.tasks)

    def train_split(self, n: int | None = None, seed: int | None = None) -> list[TaskInstance]:
        return [i for t in self.tasks.values() for i in t.train_split(n, seed)]

    def validation_split(self, n: int | None = None, seed: int | None = None) -> list[TaskInstance]:
        return [i for t in self.tasks.values() for i in t.validation_split(n, seed)]

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        raise TypeError("a mixture has no instances of its own: its tasks' splits are train_split / validation_split")

    def sft_demonstrations(self, n: int, seed: int | None = None, **kwargs: Any) -> list[list[dict[str, str]]]:
        """n demonstrations shared among the tasks by weight (largest remainders)."""
        counts = shares(self.weights, n)
        return [d for name, t in self.tasks.items() for d in t.sft_demonstrations(counts[name], seed, **kwargs)
                if counts[name]]

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        return self.for_instance(instance).demonstration(instance, rng, use_tool=use_tool, guess_correct=guess_correct)

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        return self.for_instance(instance).score(instance, outcome)

    def make_env(self, instance: TaskInstance):
        return self.for_instance(instance).make_env(instance)


def shares(weights: dict[str, float], n: int) -> dict[str, int]:
    """n split by weight, the remainders to the largest fractions (ties: declaration order)."""
    total = sum(weights.values())
    exact = {k: n * w / total for k, w in weights.items()}
    out = {k: int(v) for k, v in exact.items()}
    for k in sorted(exact, key=lambda k: out[k] - exact[k])[: n - sum(out.values())]:
        out[k] += 1
    return out


def check_mixture(cfg: Any) -> str | None:
    """A mixture setting this run's collection cannot honour (hybridrl/controller/curriculum.py), in one
    line (None when there is none); the preflight refuses it before any process starts."""
    tc, task = cfg.trainer, cfg.task
    if not task.mixture:
        return None
    if tc.rollout_mode == "partial" and task.share_policy != "none" and tc.max_groups_per_step:
        return (f"task.share_policy={task.share_policy} holds a task's extra groups itself: it does not combine with "
                "trainer.max_groups_per_step (the group queue); set one of them off")
    quota = shares({e.name: e.weight for e in task.mixture}, tc.quorum_groups)
    if tc.rollout_mode == "partial" and task.share_policy != "none" and not all(quota.values()):
        empty = [k for k, v in quota.items() if not v]
        return (f"task.mixture: with a quorum of {tc.quorum_groups} groups, task {empty[0]!r} gets no share of a step "
                "(raise trainer.quorum / prompts_per_step, or its weight)")
    return None
