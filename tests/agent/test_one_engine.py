"""One episode engine behind both doors: the built-in agent loop and the OpenAI-compatible gateway run the
same task on the same engine with the same seeds, and where the agent makes the same requests the two
trajectories are equal token for token: ids, masks, behaviour logprobs, versions, routing records (a tiny
Qwen3-MoE on the native engine) and rewards. A front end of one's own plugs in the same way."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.episodes import EpisodeEnd, EpisodeEngine, episode_runner
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.tools.base import ToolBox
from hybridrl.data.trajectory import TrajectoryStatus
from hybridrl.envs.front_ends import FRONT_ENDS
from hybridrl.envs.tasks import get_task
from hybridrl.gateway import Outcome
from hybridrl.gateway.config import GatewayConfig
from hybridrl.gateway.runner import GatewayRunner

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


async def one_request_agent(client, instance) -> Outcome:
    """What the built-in loop does for a turn with no action: one request, the answer read from it."""
    reply = await client.chat.completions.create(model="policy", messages=[dict(m) for m in instance.messages])
    answers = ANSWER.findall(reply.choices[0].message.content or "")
    return Outcome(answer=answers[0].strip() if answers else None, num_answers=len(answers))


@pytest.fixture(scope="module")
def moe_engine(tiny_models):
    from hybridrl.backends.native import NativeEngine
    from hybridrl.backends.native.config import NativeEngineConfig

    path = tiny_models("qwen3_moe", experts=8, experts_per_tok=2, init_std=0.05)
    engine = NativeEngine.from_pretrained(path, NativeEngineConfig(kv_cache_mb=8), device="cpu")
    yield path, engine
    engine.close()


def _run(runner_of, engine, instances, task):
    async def go():
        tools = await ToolBox.from_config(ToolsConfig(kill_switch="", audit_log=""), names=["calculator"]).start()
        runner = runner_of(tools)
        try:
            return await runner.run(instances, task=task, group_size=2, step=3)
        finally:
            await runner.close()
            await tools.close()

    return asyncio.run(go())


def test_both_doors_make_the_same_trajectory(moe_engine):
    from transformers import AutoTokenizer

    path, engine = moe_engine
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = get_task("calculator")
    instances = task.validation_split(2)
    agent_cfg = AgentConfig(max_turns=1, max_new_tokens_per_turn=12, max_response_tokens=64, temperature=1.0)
    built_in = _run(lambda tools: AgentRunner(engine, tokenizer, agent_cfg=agent_cfg, tools=tools, run_id="doors",
                                              seed=7), engine, instances, task)
    gateway = _run(lambda tools: GatewayRunner(engine, tokenizer, agent_cfg=agent_cfg, tools=tools, run_id="doors",
                                               seed=7, gateway_cfg=GatewayConfig(tool_parser="none"),
                                               agent=one_request_agent, server_thread=False),
                   engine, instances, task)
    assert len(built_in) == len(gateway) == 4
    for a, b in zip(built_in, gateway):
        assert a.trajectory_id == b.trajectory_id
        assert a.status != TrajectoryStatus.INFRA_INVALID and b.status != TrajectoryStatus.INFRA_INVALID
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids and a.num_policy_tokens > 0
        assert a.response_mask == b.response_mask and a.policy_versions == b.policy_versions
        # the same sampled ids; logprobs to float32 rounding: the two doors' requests reach the engine at
        # different moments, so its batches (and the last bits of a matrix product) can differ
        torch.testing.assert_close(torch.tensor(a.behavior_logprobs), torch.tensor(b.behavior_logprobs),
                                   atol=1e-5, rtol=0)
        assert a.rewards == b.rewards and a.reward == b.reward
        assert a.routed_experts is not None and b.routed_experts is not None        # R3 through the gateway too
        assert len(a.routed_experts) == len(a.prompt_ids) + len(a.response_ids) - 1
        assert torch.equal(a.routed_experts, b.routed_experts)
    # the seeds differ between episodes (attempts of one group sample differently) ...
    assert len({tuple(t.response_ids) for t in built_in}) > 1


def test_both_doors_check_the_group_size_and_apply_a_tasks_budgets(moe_engine):
    from transformers import AutoTokenizer

    path, engine = moe_engine
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = get_task("calculator")
    task.budgets = {"max_new_tokens_per_turn": 3}          # a mixture entry's own budget for its episodes
    agent_cfg = AgentConfig(max_turns=1, max_new_tokens_per_turn=12, max_response_tokens=64)

    async def go(runner):
        with pytest.raises(ValueError, match="group_size"):
            await runner.run(task.validation_split(1), task=task, group_size=0)
        out = await runner.run(task.validation_split(1), task=task, group_size=1)
        await runner.close()
        return out

    async def both():
        tools = await ToolBox.from_config(ToolsConfig(kill_switch="", audit_log=""), names=["calculator"]).start()
        runners = [AgentRunner(engine, tokenizer, agent_cfg=agent_cfg, tools=tools, run_id="b"),
                   GatewayRunner(engine, tokenizer, agent_cfg=agent_cfg, tools=tools, run_id="b",
                                 gateway_cfg=GatewayConfig(tool_parser="none"), agent=one_request_agent,
                                 server_thread=False)]
        try:
            return [await go(r) for r in runners]
        finally:
            await tools.close()

    for (traj,) in asyncio.run(both()):
        assert traj.num_policy_tokens <= 3, traj.metadata          # the task's budget, at either door


class EchoFrontEnd(EpisodeEngine):
    """A front end of one's own: one generation per episode, the prompt the instance's text as token ids."""

    def __init__(self, engine, tokenizer, **kw):
        super().__init__(engine, **kw)
        self.tokenizer = tokenizer

    @classmethod
    def from_config(cls, cfg, engine, tokenizer, *, tools, envs=None):
        return cls(engine, tokenizer, agent_cfg=cfg.agent, tools=tools, run_id=cfg.run.name, seed=cfg.run.seed)

    async def drive(self, ep):
        ep.traj.prompt_ids = self.tokenizer.encode(ep.instance.messages[-1]["content"])
        out = await self.generate_turn(ep, self.engine, ep.traj.prompt_ids, 4, turn=0)
        for seg in out.segments:
            ep.traj.append(seg.token_ids, policy=True, logprobs=seg.logprobs, version=seg.policy_version,
                           routed_experts=seg.routed_experts)
        ep.final_text = self.tokenizer.decode(out.ids)
        raise EpisodeEnd(TrajectoryStatus.COMPLETED)


def test_a_front_end_of_ones_own_is_a_row(moe_engine):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    path, engine = moe_engine
    tokenizer = AutoTokenizer.from_pretrained(path)
    name = f"{__name__}:EchoFrontEnd"
    cfg = SimpleNamespace(task=SimpleNamespace(front_end=name, agent=""), run=SimpleNamespace(name="own", seed=1),
                          agent=AgentConfig(max_turns=1))
    task = get_task("calculator")

    async def go():
        runner = episode_runner(cfg, engine, tokenizer, tools=None)
        return runner, await runner.run(task.validation_split(2), task=task, group_size=2)

    runner, trajs = asyncio.run(go())
    assert isinstance(runner, EchoFrontEnd) and FRONT_ENDS.known(name)
    assert [t.status for t in trajs] == [TrajectoryStatus.COMPLETED] * 4
    assert all(0 < t.num_policy_tokens <= 4 and t.rewards for t in trajs)      # scored by the task, as any door
    with pytest.raises(ValueError, match="takes the name 'loop' of a shipped front end"):
        FRONT_ENDS.register(EchoFrontEnd, name="loop")


def test_a_misspelled_front_end_is_refused_at_load_naming_the_key():
    from hybridrl.config import ConfigError, load_config
    from hybridrl.envs.config import TaskConfig

    with pytest.raises(ConfigError, match=r"key 'task.front_end'.*did you mean 'loop'") as err:
        load_config(None, ["task.front_end=lopo"])
    assert "\n" not in str(err.value)
    assert TaskConfig(front_end="somewhere.mine:Door").front_end == "somewhere.mine:Door"   # imported when run
    with pytest.raises(ValueError, match="not a subclass of hybridrl.agent.episodes.EpisodeEngine") as err:
        FRONT_ENDS.get(f"{__name__}:test_a_misspelled_front_end_is_refused_at_load_naming_the_key", key="task.front_end")
    assert err.value.field == "task.front_end"
