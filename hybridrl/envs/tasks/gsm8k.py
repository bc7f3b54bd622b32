"""GSM8K-style math word problems with a calculator, from a local JSONL file (nothing is downloaded).

Each line: {"question": "...", "answer": "... #### 72"} (GSM8K's own format: the rationale, its
calculator annotations <<48/2=24>>, and the final number after ####). The policy may call the
calculator (<calc>expr</calc>) and must end with <answer>N</answer>; the reward is 1 for the
right number (ExactNumber) plus the format component. Demonstrations turn the rationale's
annotations into calculator calls, so SFT teaches the tool where the data used one.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task
from hybridrl.envs.tasks.registry import register_task
from hybridrl.reward import AnswerFormat, ExactNumber, RewardResult

_ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>")
SYSTEM = ("Solve the problem step by step. For arithmetic, call the calculator as <calc>expression</calc>; "
          "its result comes back as a tool message. End with the final number as <answer>N</answer>.")


@dataclass(kw_only=True)
class GSM8KOptions:
    train_path: str = ""          # JSONL with question / answer (GSM8K train)
    validation_path: str = ""     # JSONL for validation (GSM8K test)
    system_prompt: str = SYSTEM


def final_number(answer: str) -> str:
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '#### N': {answer[-80:]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


@register_task
class GSM8KTask(Task):
    name = "gsm8k"
    version = 1
    Options = GSM8KOptions
    action_formats = ("calc", "json")

    def __init__(self, cfg):
        super().__init__(cfg)
        self.correct = ExactNumber()
        self.format = AnswerFormat()
        self._rows: dict[str, list[dict]] = {}

    def rows(self, split: str) -> list[dict]:
        key = "train_path" if split == "train" else "validation_path"
        path = getattr(self.options, key)
        if not path:
            raise ValueError(f"task gsm8k needs task.options.{key} (a local JSONL of {{question, answer}})")
        if not Path(path).exists():
            raise FileNotFoundError(f"task.options.{key}: no such file {path}")
        if path not in self._rows:
            self._rows[path] = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        return self._rows[path]

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        rows = self.rows(split)
        order = list(range(len(rows)))
        rng.shuffle(order)
        return [self.instance(rows[i]) for i in order[: min(n, len(rows))]]

    def instance(self, row: dict) -> TaskInstance:
        messages = ({"role": "system", "content": self.options.system_prompt},
                    {"role": "user", "content": row["question"].strip()})
        digest = hashlib.sha1(row["question"].encode()).hexdigest()[:12]
        return TaskInstance(task=self.name, task_id=f"gsm8k-{digest}", messages=messages,
                            reference=final_number(row["answer"]), tools=("calculator",),
                            metadata={"rationale": row["answer"].split("####")[0].strip()})

    def demonstration(self, instance: TaskInstance, rng: random.Random, *, use_tool: bool,
                      guess_correct: bool) -> list[dict[str, str]]:
        chat = [dict(m) for m in instance.messages]
        rationale = instance.metadata["rationale"]
        if use_tool:
            for expr, value in _ANNOTATION.findall(rationale):
                chat += [{"role": "assistant", "content": f"<calc>{expr.strip()}</calc>"},
                         {"role": "tool", "content": value.strip()}]
        text = _ANNOTATION.sub(lambda m: m.group(2), rationale)
        chat.append({"role": "assistant", "content": f"{text}\n<answer>{instance.reference}</answer>"})
        return chat

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        result = RewardResult()
        result.add("correct", self.correct(outcome.answer, instance.reference), self.correct.id)
        result.add("format", self.format(outcome.answer, outcome.num_answers, outcome.completed), self.format.id,
                   weight=self.cfg.format_weight)
        return result
