"""A task with a tool of its own: how many days lie between two dates.

    user:      How many days are there from 2024-02-27 to 2024-03-02?
    assistant: <tool_call>{"name": "days_between", "arguments": {"start": "2024-02-27", "end": "2024-03-02"}}</tool_call>
    tool:      4
    assistant: <answer>4</answer>

The tool is registered by this module (`@register_tool`), which the recipe's `task.name=dates:DatesTask`
imports before any episode runs; the instances name it in `tools=`, so the agent loop authorizes it
(and only it), checks its arguments against `spec.parameters`, and feeds its result back as the
`tool` turn. Try it: `hybridrl agent tasks dates.yaml --split sft -n 2` (see docs/tasks.md).
"""

from __future__ import annotations

import datetime
import hashlib
import random

from hybridrl.agent.actions import ToolSpec
from hybridrl.agent.tools import ToolResult, register_tool
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task, split_of, unique_instances
from hybridrl.reward import AnswerFormat, ExactNumber, RewardResult

DATE = {"type": "string", "maxLength": 10, "description": "a date, YYYY-MM-DD"}


class DaysBetween:
    """The tool: what the model calls, with arguments it wrote (checked against `spec` before the call)."""

    spec = ToolSpec("days_between", "Days from date `start` to date `end` (negative when `end` is earlier).",
                    {"type": "object", "properties": {"start": DATE, "end": DATE}, "required": ["start", "end"]})

    async def __call__(self, arguments: dict) -> ToolResult:
        try:
            start, end = (datetime.date.fromisoformat(arguments[k]) for k in ("start", "end"))
        except ValueError as err:             # the model's mistake: it sees the error and may try again
            return ToolResult(f"error: {err}", ok=False, error=str(err))
        return ToolResult(str((end - start).days), ok=True)


@register_tool("days_between")
def make_days_between(cfg, box) -> DaysBetween:
    """The factory: `cfg` is the `tools` config section, `box` hands out shared resources (the sandbox pool)."""
    return DaysBetween()


class DatesTask(Task):
    name = "dates"
    version = 1
    action_formats = ("json",)            # <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    render_tools = True                   # the tool's JSON schema goes into the system turn

    def __init__(self, cfg):
        super().__init__(cfg)
        self.correct, self.format = ExactNumber(), AnswerFormat()

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        def one(r: random.Random) -> TaskInstance | None:
            start = datetime.date(2000, 1, 1) + datetime.timedelta(days=r.randrange(365 * 30))
            end = start + datetime.timedelta(days=r.randint(1, 400))
            key = f"{start}/{end}"
            return self.instance(start, end) if split_of(key) == split else None

        return unique_instances(one, n, rng)

    def instance(self, start: datetime.date, end: datetime.date) -> TaskInstance:
        question = f"How many days are there from {start} to {end}?"
        return TaskInstance(task=self.name, task_id="dates-" + hashlib.sha1(question.encode()).hexdigest()[:12],
                            messages=({"role": "user", "content": question},), reference=str((end - start).days),
                            tools=("days_between",), metadata={"start": str(start), "end": str(end)})

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        chat = [dict(m) for m in instance.messages]
        if use_tool:
            call = ('<tool_call>{"name": "days_between", "arguments": {"start": "%s", "end": "%s"}}</tool_call>'
                    % (instance.metadata["start"], instance.metadata["end"]))
            chat += [{"role": "assistant", "content": call}, {"role": "tool", "content": instance.reference}]
        guess = instance.reference if use_tool or guess_correct else str(int(instance.reference) + rng.choice([-1, 1]))
        return chat + [{"role": "assistant", "content": f"<answer>{guess}</answer>"}]

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        result = RewardResult()
        result.add("correct", self.correct(outcome.answer, instance.reference), self.correct.id)
        result.add("format", self.format(outcome.answer, outcome.num_answers, outcome.completed), self.format.id,
                   weight=self.cfg.format_weight)
        return result
