"""Guess the number: a small stateful task (the environment answers "higher" / "lower").

It exists to exercise the environment path end to end (leases, sequence numbers, persisted
transitions); it is also the template of a task with a world: `make_env` + an `Environment`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from hybridrl.config.fields import check_range
from hybridrl.data.episode import EpisodeOutcome, TaskInstance, Transition
from hybridrl.envs.tasks.base import Task, split_of, unique_instances
from hybridrl.envs.tasks.registry import register_task
from hybridrl.reward import RewardResult, parse_number


@dataclass(kw_only=True)
class GuessNumberOptions:
    max_value: int = 100

    def __post_init__(self) -> None:
        check_range("max_value", self.max_value, 2, 10**9)


class GuessNumberEnv:
    """Answers each whole-number guess with "higher", "lower" or "correct". A guess of any size is
    answered (the policy's numbers are read exactly, `parse_number`); the state records it clamped to
    [0, max_value + 1], which answers the same, so the state stays small and serialisable (Python
    refuses to write an int of more than 4300 digits as text)."""

    pure = True          # its step touches nothing outside its state: the env service may re-run an in-doubt step

    def __init__(self, max_value: int = 10**9) -> None:
        self.max_value = max_value
        self.secret = 0
        self.guesses: list[int] = []

    def reset(self, instance: TaskInstance, seed: int) -> str | None:
        self.secret = int(instance.reference)
        self.guesses = []
        return None

    def step(self, action: dict[str, Any]) -> Transition:
        value = parse_number(action.get("answer"))
        if value is None or value.denominator != 1:
            return Transition("Answer with <answer>N</answer>, N a whole number.", 0.0, False)
        guess = min(max(int(value), 0), self.max_value + 1)
        self.guesses.append(guess)
        if guess == self.secret:
            return Transition("correct", 1.0, True, info={"guesses": len(self.guesses)})
        return Transition("higher" if guess < self.secret else "lower", 0.0, False)

    def state_dict(self) -> dict[str, Any]:
        return {"secret": self.secret, "guesses": list(self.guesses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.secret, self.guesses = int(state["secret"]), list(state["guesses"])

    def close(self) -> None:
        self.secret, self.guesses = 0, []


@register_task
class GuessNumberTask(Task):
    name = "guess_number"
    version = 1
    Options = GuessNumberOptions
    action_formats = ("json",)

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        top = self.options.max_value

        def one(r: random.Random) -> TaskInstance | None:
            secret = r.randint(1, top)
            key = f"{top}:{secret}"
            if split_of(key, 4) != split:
                return None
            prompt = f"I am thinking of a whole number from 1 to {top}. Guess it: <answer>N</answer>."
            return TaskInstance(task=self.name,
                                task_id=f"guess-{hashlib.sha1(key.encode()).hexdigest()[:10]}",
                                messages=({"role": "user", "content": prompt},), reference=str(secret))

        return unique_instances(one, min(n, top // (2 if split == "train" else 8)), rng)

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        lo, hi, secret = 1, self.options.max_value, int(instance.reference)
        chat = [dict(m) for m in instance.messages]
        while True:
            mid = (lo + hi) // 2
            chat.append({"role": "assistant", "content": f"<answer>{mid}</answer>"})
            if mid == secret:
                return chat
            chat.append({"role": "user", "content": "higher" if mid < secret else "lower"})
            lo, hi = (mid + 1, hi) if mid < secret else (lo, mid - 1)

    def make_env(self, instance: TaskInstance) -> GuessNumberEnv:
        return GuessNumberEnv(self.options.max_value)

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        return RewardResult().add("found", outcome.env_return, f"{self.name}_env@{self.version}")
