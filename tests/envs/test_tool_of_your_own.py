"""The README's "a tool of your own" walk-through, replayed: `examples/dates.py` and its recipe
`examples/dates.yaml` copied into a directory (as a user does), its demonstrations through the real
CLI, and its episodes through the real agent loop (a scripted engine writes the tool call and the
answer): the tool registered by the task module is built, authorized, checked and called; its result
reaches the model; a bad argument is the model's error, a tool the instance does not name is refused.
Every `examples/` file the README or a docs page cites exists."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.launch import ROOT, env_with_repo


@pytest.fixture
def user_dir(tmp_path):
    """The README's `cp examples/dates.py examples/dates.yaml .`"""
    for name in ("dates.py", "dates.yaml"):
        shutil.copy(ROOT / "examples" / name, tmp_path / name)
    return tmp_path


def test_the_docs_cite_example_files_that_exist():
    texts = [(ROOT / "README.md").read_text(), *(p.read_text() for p in (ROOT / "docs").rglob("*.md"))]
    cited = {c for text in texts for c in re.findall(r"(?<![\w/])examples/[\w./-]*\w", text)}
    assert {"examples/dates.py", "examples/dates.yaml"} <= cited
    assert [c for c in sorted(cited) if not (ROOT / c).exists()] == []


def test_the_demonstrations_call_the_tool_through_the_cli(user_dir):
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "agent", "tasks", "dates.yaml", "--split", "sft", "-n", "2"],
                          cwd=user_dir, env=env_with_repo(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    chats = [json.loads(line)["messages"] for line in proc.stdout.splitlines()]
    assert len(chats) == 2
    for chat in chats:
        call = json.loads(re.search(r"<tool_call>(.*)</tool_call>", chat[1]["content"]).group(1))
        assert call["name"] == "days_between" and chat[2] == {"role": "tool", "content": chat[3]["content"][8:-9]}


def responder(tokenizer, *, start=None, tool="days_between"):
    """Turn 0: call the tool with the question's dates (or `start` instead of the first); turn 1: answer
    with what the tool said."""
    def respond(ids, turn):
        text = tokenizer.decode(ids)
        if turn == 0:
            a, b = re.findall(r"\d{4}-\d\d-\d\d", text.split("How many days")[-1])[:2]
            return '<tool_call>{"name": "%s", "arguments": {"start": "%s", "end": "%s"}}</tool_call>' % (
                tool, start or a, b)
        said = text.rsplit("tool\n", 1)[1].split("<|im_end|>")[0].strip()
        return f"<answer>{said}</answer>"
    return respond


def test_episodes_call_the_tool_in_the_agent_loop(user_dir, monkeypatch, tokenizer):
    from hybridrl.agent.loop import AgentRunner
    from hybridrl.agent.testing import ScriptedEngine
    from hybridrl.agent.tools import ToolBox, tool_names
    from hybridrl.config import load_config
    from hybridrl.data.trajectory import TrajectoryStatus
    from hybridrl.envs.tasks import get_task

    monkeypatch.syspath_prepend(str(user_dir))
    cfg = load_config(str(user_dir / "dates.yaml"))               # imports dates.py: the tool registers
    assert "days_between" in tool_names()
    task = get_task(cfg.task.name, cfg.task)
    instances = task.validation_split(4)

    def run(respond):
        box = ToolBox.from_config(cfg.tools, names=["days_between"])
        runner = AgentRunner(ScriptedEngine(tokenizer, respond), tokenizer, agent_cfg=cfg.agent, tools=box, run_id="t")
        return asyncio.run(runner.run(instances, task=task))

    solved = run(responder(tokenizer))
    assert [t.status for t in solved] == [TrajectoryStatus.COMPLETED] * 4
    assert [t.rewards["correct"] for t in solved] == [1.0] * 4
    for t in solved:                      # the answer is what the tool said: right for every instance
        [call] = t.tool_calls
        assert call.ok and call.name == "days_between" and call.error is None
    assert "days_between" in tokenizer.decode(solved[0].prompt_ids)      # its schema is in the system turn

    bad_date = run(responder(tokenizer, start="2023-02-30"))[0]           # the model's mistake, told to it
    assert not bad_date.tool_calls[0].ok and "day is out of range" in bad_date.tool_calls[0].error
    assert bad_date.rewards["correct"] == 0.0
    refused = run(responder(tokenizer, tool="python"))[0]                 # not named by the instance
    assert not refused.tool_calls[0].ok and "not available" in refused.tool_calls[0].error
