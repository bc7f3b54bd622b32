"""`hybridrl init agent`: the scaffolded OpenAI-client agent solves calculator episodes through the gateway
(a scripted engine that calls the tool, then answers), and its recipe runs through `hybridrl eval` on a
tiny model (the agent's episodes, through the real gateway, outside training)."""

from __future__ import annotations

import importlib
import json
import sys

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config

pytest.importorskip("openai", reason="pip install -e .[gateway]")


@pytest.fixture
def fresh_modules():
    """The scaffolded module is imported by name: forget it afterwards, so tests do not share it."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("myagent", "agents", "counted")):
            del sys.modules[name]


def test_init_agent_writes_an_agent_and_a_recipe_that_loads(tmp_path, monkeypatch, fresh_modules, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "agent", "myagent"]) == 0
    out = capsys.readouterr().out
    assert "hybridrl eval myagent_grpo.yaml" in out and "docs/agents-howto.md" in out
    assert main(["init", "agent", "myagent"]) == 2                    # never overwrites without --force
    assert main(["init", "agent", "My-Agent"]) == 2                   # not a module name
    cfg = load_config("myagent_grpo.yaml")
    assert cfg.task.name == "calculator" and cfg.task.agent == "myagent:run"
    assert cfg.gateway.render_tools is False and cfg.model.path == "runs/demo/sft/hf"

    assert main(["init", "agent", "myagent", "--dir", "agents", "--task", "feet:FeetTask", "--model", "m",
                 "--render-tools"]) == 0
    text = (tmp_path / "agents" / "myagent_grpo.yaml").read_text()
    assert "agent: agents.myagent:run" in text and "name: feet:FeetTask" in text
    assert "render_tools: true" in text and "path: m\n" in text


def test_the_scaffolded_agent_calls_the_tool_and_answers(tmp_path, monkeypatch, fresh_modules, tiny_tokenizer):
    from hybridrl.agent.testing import ScriptedEngine, calculator_oracle
    from hybridrl.data.trajectory import TrajectoryStatus
    from tests.gateway.helpers import run_agent

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["init", "agent", "myagent"]) == 0
    agent = importlib.import_module("myagent").run
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=1, call_format="json"))
    trajs, runner = run_agent(engine, tiny_tokenizer, agent, n=3)
    assert len(trajs) == 3
    for t in trajs:
        assert t.status == TrajectoryStatus.COMPLETED and t.reward == 1.0, t.metadata
        assert [c.name for c in t.tool_calls] == ["calculator"] and t.turns == 2
    assert runner.counts["agent_errors"] == 0


def test_the_scaffolded_recipe_runs_its_agent_through_eval(tmp_path, monkeypatch, fresh_modules, tiny_models):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tiny_models("qwen2")
    # a name of its own: the working directories of earlier tests may still be on sys.path
    assert main(["init", "agent", "counted", "--model", str(model)]) == 0
    # the agent counts its episodes in a file: proof that the recipe's episodes ran this module's `run`
    path = tmp_path / "counted.py"
    path.write_text(path.read_text().replace(
        '    messages = [dict(m) for m in instance.messages]\n',
        '    messages = [dict(m) for m in instance.messages]\n'
        '    open("episodes.txt", "a").write(instance.task_id + "\\n")\n', 1))
    assert main(["eval", "counted_grpo.yaml", "-n", "3", "--json", "out.json", "--no-progress"]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["task"] == "calculator" and result["instances"] == 3
    assert result["greedy"]["episodes"] == result["sampled"]["episodes"] == 3
    assert len((tmp_path / "episodes.txt").read_text().split()) == 6       # greedy + sampled, 3 each
