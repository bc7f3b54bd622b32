"""SFT demonstrations are laid out token for token as the agent loop lays out episodes, so the
warm start teaches exactly the sequences RL will sample and train on."""

from __future__ import annotations

import asyncio

import pytest

from hybridrl.agent.chat import ChatFormat
from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.testing import ScriptedEngine
from hybridrl.agent.tools.base import ToolBox
from hybridrl.envs.config import TaskConfig
from hybridrl.envs.tasks import get_task


def _demo_replayer(demos_by_question):
    """Replays the assistant turns of the demonstration whose question is in the prompt."""

    def respond(ids, turn):
        return demos_by_question(ids)[turn]

    return respond


@pytest.mark.parametrize("use_tool", [True, False])
def test_demonstration_layout_equals_the_agent_loop_episode(tokenizer, use_tool):
    import random

    task = get_task("calculator", TaskConfig(name="calculator", train_size=16, validation_size=8))
    instances = task.train_split(4)
    demos = {i.task_id: task.demonstration(i, random.Random(0), use_tool=use_tool, guess_correct=True)
             for i in instances}
    by_question = {i.messages[-1]["content"]: demos[i.task_id] for i in instances}

    def lookup(ids):
        text = tokenizer.decode(ids, skip_special_tokens=False)
        question = next(q for q in by_question if q in text)
        return [m["content"] for m in by_question[question] if m["role"] == "assistant"]

    engine = ScriptedEngine(tokenizer, _demo_replayer(lookup))
    chat = ChatFormat(tokenizer)

    async def go():
        async with ToolBox.from_config(ToolsConfig(isolation="none", pool_size=1, warm=0),
                                       names=["calculator"]) as tools:
            runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(), tools=tools, run_id="t")
            return await runner.run(instances, task=task, group_size=1)

    for inst, traj in zip(instances, asyncio.run(go())):
        assert traj.reward == 1.0 and traj.status.value == "completed"
        ids, mask = chat.conversation_ids(demos[inst.task_id])
        assert traj.prompt_ids + traj.response_ids == ids
        assert [0] * len(traj.prompt_ids) + traj.response_mask == mask
