"""The GSM8K-style task reads a local JSONL, scores numbers, and turns annotations into tool calls."""

from __future__ import annotations

import json
import random

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.envs.tasks import get_task
from hybridrl.data.episode import EpisodeOutcome

ROWS = [{"question": f"Tom has {i} boxes of 12 apples. How many apples?",
         "answer": f"He has {i}*12 = <<{i}*12={i * 12}>>{i * 12} apples.\n#### {i * 12}"} for i in range(2, 12)]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_splits_score_and_demonstrations(data):
    cfg = load_config(None, ["task.name=gsm8k", f"task.options.train_path={data}",
                             f"task.options.validation_path={data}"]).task
    task = get_task("gsm8k", cfg)
    train = task.train_split(4)
    assert len(train) == 4 and all(i.tools == ("calculator",) for i in train)
    inst = train[0]
    ok = task.score(inst, EpisodeOutcome(answer=inst.reference, num_answers=1, final_text="", completed=True))
    bad = task.score(inst, EpisodeOutcome(answer="1", num_answers=1, final_text="", completed=True))
    assert ok.rewards["correct"] == 1.0 and bad.rewards["correct"] == 0.0
    demo = task.demonstration(inst, random.Random(0), use_tool=True, guess_correct=True)
    assert [m["role"] for m in demo[2:]] == ["assistant", "tool", "assistant"]
    assert demo[2]["content"].startswith("<calc>") and demo[3]["content"] == inst.reference
    assert demo[-1]["content"].endswith(f"<answer>{inst.reference}</answer>") and "<<" not in demo[-1]["content"]


def test_missing_file_names_the_option(tmp_path):
    cfg = load_config(None, ["task.name=gsm8k", f"task.options.train_path={tmp_path / 'nope.jsonl'}"]).task
    with pytest.raises(FileNotFoundError, match="task.options.train_path: no such file"):
        get_task("gsm8k", cfg).train_split(2)
    with pytest.raises(ConfigError, match="task.options"):
        load_config(None, ["task.name=gsm8k", "task.options.no_such_option=1"])
