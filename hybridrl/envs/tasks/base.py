"""The `Task` interface: instances (prompts + references), splits, SFT demonstrations, the
action formats the agent parses, the reward, and optionally a stateful environment.

A task is one small file: subclass `Task`, give it `name`, an `Options` dataclass, and
implement `make_instances`, `demonstration`, `score` (and `make_env` for stateful tasks).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, ClassVar, Sequence

from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.reward.base import RewardResult

if TYPE_CHECKING:
    from hybridrl.envs.config import TaskConfig
    from hybridrl.envs.protocol import Environment


class Task:
    name: ClassVar[str] = ""
    version: ClassVar[int] = 1
    Options: ClassVar[type] = type(None)
    action_formats: ClassVar[tuple[str, ...]] = ("json",)
    render_tools: ClassVar[bool] = False       # list the tools' JSON schemas in the system turn
    budgets: dict = {}                          # episode budgets of this task's own (a mixture's entry: agent.*)

    def __init__(self, cfg: "TaskConfig"):
        from hybridrl.envs.tasks.registry import task_options

        self.cfg = cfg
        self.options = task_options(type(self), cfg.options)

    # ------------------------------------------------------------------ to implement

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        """`n` instances of `split` ("train" | "validation"); the two must be disjoint."""
        raise NotImplementedError

    def demonstration(self, instance: TaskInstance, rng: random.Random, *, use_tool: bool,
                      guess_correct: bool) -> list[dict[str, str]]:
        """A full chat (prompt + assistant/tool turns) solving `instance`, for SFT."""
        raise NotImplementedError

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        raise NotImplementedError

    def make_env(self, instance: TaskInstance) -> "Environment | None":
        """A stateful environment for the episode, or None for tool-only tasks."""
        return None

    # ------------------------------------------------------------------ provided

    def for_instance(self, instance: TaskInstance) -> "Task":
        """The task that parses, scores and builds the environment of `instance` (a mixture: its entry's)."""
        return self

    def task_names(self) -> list[str]:
        """The tasks whose instances this task runs."""
        return [self.name]

    def train_split(self, n: int | None = None, seed: int | None = None) -> list[TaskInstance]:
        return self._split("train", n or self.cfg.train_size, self.cfg.seed if seed is None else seed)

    def validation_split(self, n: int | None = None, seed: int | None = None) -> list[TaskInstance]:
        return self._split("validation", n or self.cfg.validation_size,
                           self.cfg.seed if seed is None else seed)

    def _split(self, split: str, n: int, seed: int) -> list[TaskInstance]:
        rng = random.Random(f"{self.name}/{split}/{seed}")
        return self.make_instances(n, rng, split)

    def sft_demonstrations(self, n: int, seed: int | None = None, *, tool_use_fraction: float | None = None,
                           guess_correct_fraction: float | None = None) -> list[list[dict[str, str]]]:
        """`n` chats from the train distribution: a `tool_use_fraction` of them use the tool, the
        rest guess (right in a `guess_correct_fraction` of cases). Seeded and deterministic."""
        tool_use = self.cfg.sft_tool_use_fraction if tool_use_fraction is None else tool_use_fraction
        correct = self.cfg.sft_guess_correct_fraction if guess_correct_fraction is None else guess_correct_fraction
        for name, value in (("tool_use_fraction", tool_use), ("guess_correct_fraction", correct)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        seed = self.cfg.seed if seed is None else seed
        instances = self._split("train", n, seed + 1_000_003)
        rng = random.Random(f"{self.name}/sft/{seed}")
        num_tool = round(tool_use * n)
        use_tool = [True] * num_tool + [False] * (n - num_tool)
        rng.shuffle(use_tool)
        return [self.demonstration(inst, rng, use_tool=u, guess_correct=rng.random() < correct)
                for inst, u in zip(instances, use_tool)]


def unique_instances(make_one, n: int, rng: random.Random, *, max_tries: int = 100) -> list[TaskInstance]:
    """Draw `n` instances with distinct task ids from `make_one(rng) -> TaskInstance | None`."""
    seen: set[str] = set()
    out: list[TaskInstance] = []
    tries = 0
    while len(out) < n:
        inst = make_one(rng)
        tries += 1
        if tries > max_tries * n + 1000:
            raise ValueError(f"could not draw {n} distinct instances (got {len(out)}): widen the task options")
        if inst is None or inst.task_id in seen:
            continue
        seen.add(inst.task_id)
        out.append(inst)
    return out


def split_of(key: str, validation_share: int = 8) -> str:
    """A fixed partition of the instance space: 1 in `validation_share` keys is validation."""
    import hashlib

    return "validation" if hashlib.sha256(key.encode()).digest()[0] % validation_share == 0 else "train"


def chat(messages: Sequence[tuple[str, str]]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in messages]
