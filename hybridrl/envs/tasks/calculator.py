"""The calculator task: arithmetic a small model cannot do in its head, with a calculator tool.

    user:      What is 4821 * 37 + 905?
    assistant: <calc>4821 * 37 + 905</calc>
    tool:      179282
    assistant: <answer>179282</answer>

Operands have `min_digits`..`max_digits` digits, joined by `min_ops`..`max_ops` operators from
`ops`; with two operators, a `parentheses` share groups the first pair. Answers are computed
with the same safe evaluator the tool uses (never `eval`). Train and validation come from a
fixed hash partition of the expressions, so they never overlap whatever their sizes and seeds.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

from hybridrl.envs.arithmetic import evaluate, format_value
from hybridrl.config.fields import ConfigValueError, check_choice, check_range
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task, split_of, unique_instances
from hybridrl.envs.tasks.registry import register_task
from hybridrl.reward import AnswerFormat, ExactNumber, RewardResult


@dataclass(kw_only=True)
class CalculatorOptions:
    min_digits: int = 2
    max_digits: int = 4
    min_ops: int = 1
    max_ops: int = 2
    ops: str = "+-*"
    parentheses: float = 0.3          # share of two-operator questions written as (a o b) o c
    action_format: str = "calc"       # what demonstrations use: calc (<calc>) | json (<tool_call>)
    system_prompt: str = ""           # empty: no system turn (shorter episodes)

    def __post_init__(self) -> None:
        check_range("min_digits", self.min_digits, 1, 12)
        check_range("max_digits", self.max_digits, self.min_digits, 12)
        check_range("min_ops", self.min_ops, 1, 4)
        check_range("max_ops", self.max_ops, self.min_ops, 4)
        if not self.ops or set(self.ops) - set("+-*"):
            raise ConfigValueError("ops", f"must be a non-empty subset of '+-*', got {self.ops!r}")
        check_range("parentheses", self.parentheses, 0.0, 1.0)
        check_choice("action_format", self.action_format, ("calc", "json"))


@register_task
class CalculatorTask(Task):
    name = "calculator"
    version = 1
    Options = CalculatorOptions
    action_formats = ("calc", "json")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.correct = ExactNumber()
        self.format = AnswerFormat()

    def expression(self, rng: random.Random) -> str:
        o = self.options
        num_ops = rng.randint(o.min_ops, o.max_ops)
        terms = [str(rng.randint(10 ** (d - 1) if d > 1 else 0, 10 ** d - 1))
                 for d in (rng.randint(o.min_digits, o.max_digits) for _ in range(num_ops + 1))]
        ops = [rng.choice(o.ops) for _ in range(num_ops)]
        text = terms[0]
        for i, (op, term) in enumerate(zip(ops, terms[1:])):
            text = f"{text} {op} {term}"
            if i == 0 and num_ops >= 2 and rng.random() < o.parentheses:
                text = f"({text})"
        return text

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        def one(r: random.Random) -> TaskInstance | None:
            expr = self.expression(r)
            if split_of(expr) != split:
                return None
            return self.instance(expr)

        return unique_instances(one, n, rng)

    def instance(self, expression: str) -> TaskInstance:
        value = format_value(evaluate(expression))
        messages = ([{"role": "system",
                      "content": self.options.system_prompt}] if self.options.system_prompt else [])
        messages.append({"role": "user", "content": f"What is {expression}?"})
        digest = hashlib.sha1(expression.encode()).hexdigest()[:12]
        return TaskInstance(task=self.name, task_id=f"calc-{digest}", messages=tuple(messages),
                            reference=value,
                            tools=("calculator",), metadata={"expression": expression})

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        chat = [dict(m) for m in instance.messages]
        expr = instance.metadata["expression"]
        if use_tool:
            if self.options.action_format == "calc":
                call = f"<calc>{expr}</calc>"
            else:
                call = "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expr}}) \
                       + "</tool_call>"
            chat += [{"role": "assistant", "content": call}, {"role": "tool", "content": instance.reference},
                     {"role": "assistant", "content": f"<answer>{instance.reference}</answer>"}]
            return chat
        guess = instance.reference if guess_correct else near_miss(int(instance.reference), rng)
        chat.append({"role": "assistant", "content": f"<answer>{guess}</answer>"})
        return chat

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        result = RewardResult()
        result.add("correct", self.correct(outcome.answer, instance.reference), self.correct.id)
        result.add("format", self.format(outcome.answer, outcome.num_answers, outcome.completed),
                   self.format.id,
                   weight=self.cfg.format_weight)
        return result


def near_miss(value: int, rng: random.Random) -> str:
    """A plausible wrong guess: same sign and magnitude, different low digits."""
    for _ in range(100):
        scale = max(1, abs(value) // 100)
        guess = value + rng.choice([-1, 1]) * rng.randint(1, 9 * scale)
        if guess != value and (guess < 0) == (value < 0):
            return str(guess)
    return str(value + 1)
