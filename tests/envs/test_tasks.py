"""Tasks: the calculator's splits, answers and demonstrations; the registry; a stateful task
running through the agent loop and the leased service."""

from __future__ import annotations

import asyncio
import re
from fractions import Fraction

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.config.fields import ConfigValueError
from hybridrl.envs.config import TaskConfig
from hybridrl.envs.tasks import EpisodeOutcome, get_task, task_names


def test_registry_and_option_validation():
    assert {"calculator", "guess_number"} <= set(task_names())
    with pytest.raises(ConfigValueError, match="unknown task 'nope'.*'module:Class'"):
        get_task("nope")
    with pytest.raises(ConfigValueError, match="unknown option of task 'calculator'"):
        TaskConfig(options={"max_digit": 3})
    with pytest.raises(ConfigError, match="key 'task.options.max_digits': must be in"):
        load_config(None, ["task.options={min_digits: 5, max_digits: 3}"])
    with pytest.raises(ConfigError, match="key 'task.name': unknown task 'calculater': did you mean 'calculator'"):
        load_config(None, ["task.name=calculater"])


def test_calculator_splits_are_seeded_disjoint_and_correct():
    task = get_task("calculator", TaskConfig(options={"min_digits": 2, "max_digits": 4}))
    train, val = task.train_split(400, seed=0), task.validation_split(100, seed=0)
    assert [i.task_id for i in train] == [i.task_id for i in task.train_split(400, seed=0)]
    assert [i.task_id for i in train] != [i.task_id for i in task.train_split(400, seed=1)]
    assert not {i.task_id for i in train} & {i.task_id for i in val}
    assert len({i.task_id for i in train}) == 400
    ops_seen = set()
    for inst in train + val:
        expr = inst.metadata["expression"]
        assert inst.messages[-1]["content"] == f"What is {expr}?" and inst.tools == ("calculator",)
        # noqa: S307 - reference on our own expression
        assert Fraction(inst.reference) == Fraction(eval(expr))
        numbers = re.findall(r"\d+", expr)
        assert 2 <= len(numbers) <= 3 and all(2 <= len(n) <= 4 and not n.startswith("0") for n in numbers)
        ops_seen |= set(re.findall(r" ([-+*]) ", expr))
    assert ops_seen == {"+", "-", "*"}
    assert any("(" in i.metadata["expression"] for i in train)


def test_calculator_reward_is_versioned_and_checks_format():
    task = get_task("calculator", TaskConfig(format_weight=0.5))
    [inst] = task.train_split(1)
    right = EpisodeOutcome(answer=f"00{inst.reference}" if not inst.reference.startswith("-") else inst.reference,
                           num_answers=1, final_text="", completed=True)
    r = task.score(inst, right)
    assert r.rewards == {"correct": 1.0, "format": 1.0} and r.total == 1.5
    assert r.evaluators == {"correct": "exact_number@1", "format": "answer_format@1"}
    for outcome in (EpisodeOutcome(answer="12*3", num_answers=1, final_text="", completed=True),
                    EpisodeOutcome(answer=None, num_answers=0, final_text="", completed=False)):
        assert task.score(inst, outcome).total == 0.0
    twice = EpisodeOutcome(answer=inst.reference, num_answers=2, final_text="", completed=True)
    assert task.score(inst, twice).rewards == {"correct": 1.0, "format": 0.0}


def test_sft_demonstrations_have_the_requested_quality(tokenizer):
    task = get_task("calculator")
    demos = task.sft_demonstrations(200, seed=0, tool_use_fraction=0.3, guess_correct_fraction=0.0)
    assert demos == task.sft_demonstrations(200, seed=0, tool_use_fraction=0.3, guess_correct_fraction=0.0)
    tool_demos = [d for d in demos if any(m["role"] == "tool" for m in d)]
    assert len(tool_demos) == 60
    for d in demos:
        expr = re.match(r"What is (.*)\?", d[0]["content"]).group(1)
        value = str(eval(expr))  # noqa: S307
        answer = re.fullmatch(r"<answer>(.*)</answer>", d[-1]["content"]).group(1)
        if d in tool_demos:
            assert [m["role"] for m in d] == ["user", "assistant", "tool", "assistant"]
            assert d[1]["content"] == f"<calc>{expr}</calc>" and d[2]["content"] == value == answer
        else:
            assert [m["role"] for m in d] == ["user", "assistant"] and answer != value
    lengths = [len(tokenizer.apply_chat_template(d, tokenize=False)) for d in tool_demos]
    tokens = [len(tokenizer.encode(tokenizer.apply_chat_template(d, tokenize=False))) for d in tool_demos]
    assert 35 <= sum(tokens) / len(tokens) <= 70, sum(tokens) / len(tokens)
    assert all(lengths)
    right = task.sft_demonstrations(20, seed=0, tool_use_fraction=0.0, guess_correct_fraction=1.0)
    # noqa: S307
    assert all(d[-1]["content"] == f"<answer>{eval(d[0]['content'][8:-1])}</answer>" for d in right)
    json_task = get_task("calculator", TaskConfig(options={"action_format": "json"}))
    assert json_task.sft_demonstrations(1,
                                        seed=0)[0][1]["content"].startswith('<tool_call>{"name": "calculator"')


def test_stateful_task_through_the_agent_loop_and_the_leased_service(tokenizer, tmp_path):
    from hybridrl.agent.config import AgentConfig
    from hybridrl.agent.loop import AgentRunner
    from hybridrl.agent.testing import ScriptedEngine
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.data.trajectory import TrajectoryStatus
    from hybridrl.envs.client import LeasedEnvProvider
    from hybridrl.envs.service import EnvService

    task = get_task("guess_number")

    def bisect(ids, turn):                     # a perfect player: binary search on the feedback
        text = tokenizer.decode(ids)
        lo, hi = 1, 100
        for guess, hint in re.findall(r"<answer>(\d+)</answer><\|im_end\|>\n<\|im_start\|>user\n(\w+)", text):
            lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
        return f"<answer>{(lo + hi) // 2}</answer>"

    svc = EnvService(tmp_path / "envs.sqlite")
    runner = AgentRunner(ScriptedEngine(tokenizer, bisect), tokenizer, agent_cfg=AgentConfig(max_turns=8),
                         tools=ToolBox([]), run_id="r", envs=LeasedEnvProvider(svc))
    insts = task.train_split(5, seed=0)
    trajs = asyncio.run(runner.run(insts, task=task, group_size=2))
    assert all(t.status == TrajectoryStatus.COMPLETED and t.reward == 1.0 for t in trajs)
    assert all(t.metadata["env_steps"] == t.turns for t in trajs)
    rows = svc.db.execute("SELECT status, last_seq FROM episodes").fetchall()
    assert len(rows) == 10 and all(status == "closed" for status, _ in rows)
    assert sorted(seq for _, seq in rows) == sorted(t.turns for t in trajs)
    kinds = [k for k, _ in svc.events()]
    assert kinds.count("step") == sum(t.turns for t in trajs) and kinds.count("close") == 10
