"""The README's "Writing a new task" example is real code: it registers, draws disjoint seeded
splits, its demonstrations parse and score 1, and a wrong answer scores 0."""

from __future__ import annotations

import re

from hybridrl.config import load_config
from hybridrl.agent.actions import ActionParser
from hybridrl.data.episode import EpisodeOutcome
from hybridrl.envs.tasks.registry import get_task
from tests.launch import ROOT

IMPORTS = """
from dataclasses import dataclass
from hybridrl.envs.tasks import Task, TaskInstance, register_task, split_of, unique_instances
from hybridrl.reward import RewardResult
"""


def readme_task_source() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("### Writing a new task", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_task_example_runs(tmp_path):
    namespace: dict = {}
    exec(compile(IMPORTS + readme_task_source(), "README.md", "exec"), namespace)
    recipe = tmp_path / "reverse.yaml"
    recipe.write_text("task:\n  name: reverse\n  options:\n    max_len: 6\n")
    cfg = load_config(recipe, [])
    task = get_task("reverse", cfg.task)
    train, val = task.train_split(50), task.validation_split(5)
    assert len(train) == 50 and len(val) == 5
    assert not {t.task_id for t in train} & {v.task_id for v in val}
    assert train == task.train_split(50)                          # seeded
    assert all(3 <= len(t.reference) <= 6 for t in train)
    parser = ActionParser(task.action_formats)
    for inst in val:
        chat = task.demonstration(inst, None, use_tool=False, guess_correct=True)
        answer = parser.parse(chat[-1]["content"]).answer
        right = task.score(inst, EpisodeOutcome(answer=answer, num_answers=1, final_text="", completed=True))
        wrong = task.score(inst, EpisodeOutcome(answer=answer + "x", num_answers=1, final_text="", completed=True))
        assert (right.total, wrong.total) == (1.0, 0.0)
