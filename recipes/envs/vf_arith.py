"""A tiny verifiers environment (verifiers 0.4, `verifiers.v1`): arithmetic questions in the demo's
calculator format, scored by the environment's own weighted rewards. Written as any verifiers user
would write one; hybridrl trains it with

    task:
      name: verifiers
      options:
        environment: recipes/envs/vf_arith.py:load_environment   # or module:function
        kwargs: {num_tasks: 2000, seed: 0}

`load_environment(**kwargs)` returns the taskset; its tasks are the episodes' instances, and each
task's `@vf.reward` methods (`correct` weight 1, `concise` weight 0.1) are the reward components.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

__all__ = ["ArithTaskset", "load_environment"]

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        """1 when the last <answer> of the final reply is the result."""
        found = ANSWER.findall(trace.last_reply)
        return float(bool(found) and found[-1].strip() == task.answer)

    @vf.reward(weight=0.1)
    async def concise(self, trace: vf.Trace) -> float:
        """1 for an answer within three assistant turns, else 0."""
        return float(len(trace.assistant_messages) <= 3 and bool(ANSWER.search(trace.last_reply)))


class ArithConfig(vf.TasksetConfig):
    num_tasks: int = 2000
    seed: int = 0
    max_digits: int = 4


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        """One or two operators of + - * between operands of 2..max_digits digits, as the demo's questions."""
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            terms = [str(rng.randint(10, 10 ** rng.randint(2, self.config.max_digits) - 1))
                     for _ in range(rng.randint(2, 3))]
            expr = terms[0]
            for term in terms[1:]:
                expr = f"{expr} {rng.choice('+-*')} {term}"
            value = eval(expr)  # noqa: S307 - the environment's own integers and operators
            yield ArithTask(ArithData(id=f"arith-{self.config.seed}-{i}", prompt=f"What is {expr}?",
                                      answer=str(value)), self.config.task)


def load_environment(num_tasks: int = 2000, seed: int = 0, max_digits: int = 4) -> ArithTaskset:
    return ArithTaskset(ArithConfig(num_tasks=num_tasks, seed=seed, max_digits=max_digits))
