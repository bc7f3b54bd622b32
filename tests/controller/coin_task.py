"""A task only a guess can answer, for the learning-signal tests: "Toss 17: heads (1) or tails (0)?"
is answered `<answer>1</answer>` or `<answer>0</answer>`, and which one is right follows from a hash
of the toss's number, which the prompt does not give away. A model that learned the answer's format
is right about half the time whatever it does (every group of a few samples has different rewards);
a random model never writes an answer at all."""

from __future__ import annotations

import hashlib
import random

from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task, split_of
from hybridrl.reward import AnswerFormat, ExactNumber, RewardResult


class CoinTask(Task):
    name = "coin"
    version = 1

    def __init__(self, cfg):
        super().__init__(cfg)
        self.correct, self.format = ExactNumber(), AnswerFormat()

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        out, toss = [], rng.randrange(10**6)
        while len(out) < n:
            toss += 1
            if split_of(f"toss-{toss}") == split:
                out.append(self.instance(toss))
        return out

    def instance(self, toss: int) -> TaskInstance:
        side = str(hashlib.sha256(str(toss).encode()).digest()[0] % 2)
        return TaskInstance(task=self.name, task_id=f"coin-{toss}", reference=side, tools=(),
                            messages=({"role": "user", "content": f"Toss {toss}: heads (1) or tails (0)?"},))

    def demonstration(self, instance, rng, *, use_tool, guess_correct):
        return [dict(m) for m in instance.messages] + [{"role": "assistant",
                                                        "content": f"<answer>{instance.reference}</answer>"}]

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        result = RewardResult()
        result.add("correct", self.correct(outcome.answer, instance.reference), self.correct.id)
        result.add("format", self.format(outcome.answer, outcome.num_answers, outcome.completed), self.format.id,
                   weight=self.cfg.format_weight)
        return result


class PythonCoinTask(CoinTask):
    """The coin task whose instances may call the `python` tool: a run of it keeps a sandbox pool warm on
    every rank that generates (what the process-leak tests need to see ended)."""

    name = "coin_python"

    def instance(self, toss: int) -> TaskInstance:
        inst = super().instance(toss)
        return TaskInstance(task=self.name, task_id=inst.task_id, reference=inst.reference, tools=("python",),
                            messages=inst.messages)
