"""The disaggregated placement's producer on one engine (scripted, real agent loop): groups start only
once the engine serves their floor, a lowered floor releases them, take hands back whole groups in
attempt order, and an episode that spans a weight update keeps each token's own version."""

from __future__ import annotations

import asyncio
import time

import pytest

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.producer import LoopThread, Producer
from hybridrl.agent.testing import ScriptedEngine
from hybridrl.agent.tools.base import ToolBox
from hybridrl.agent.tools.calculator import CalculatorTool
from hybridrl.data.trajectory import TrajectoryStatus as S
from tests.agent.test_collector import LONG, TASK, _instance


@pytest.fixture
def setup(tokenizer):
    def respond(ids, turn):
        return LONG if "take your time" in tokenizer.decode(ids) else "<answer>5</answer>"

    threads = LoopThread()
    engine = ScriptedEngine(tokenizer, respond, step_latency_s=0.002)
    runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(max_new_tokens_per_turn=200), tools=ToolBox([CalculatorTool()]),
                         run_id="t")
    producer = Producer(runner, TASK, threads.loop)
    yield engine, threads, producer
    threads.stop()


def _group(task_id: str, size: int, step: int = 1):
    inst = _instance(task_id)
    return [(inst, a, f"{task_id}@{step}") for a in range(size)]


def test_a_group_waits_for_its_floor_and_comes_back_whole(setup):
    engine, threads, producer = setup
    producer.grant([_group("now", 3)], floor=0)
    producer.grant([_group("later", 2, step=2)], floor=1)            # needs the next policy version
    got = producer.take(["now@1"])
    assert [t.attempt for t in got] == [0, 1, 2] and {t.group_id for t in got} == {"now@1"}
    assert all(t.status == S.COMPLETED and t.policy_versions and set(t.policy_versions) == {0} for t in got)
    time.sleep(0.1)
    stats = producer.stats()
    assert stats["waiting_groups"] == 1 and stats["running_groups"] == 0      # "later" has not started
    assert stats["idle_s"] > 0.05                                               # nothing to run meanwhile
    threads.run(engine.update_weights([], 1))
    producer.poke()
    later = producer.take(["later@2"])
    assert [t.attempt for t in later] == [0, 1] and all(set(t.policy_versions) == {1} for t in later)
    assert producer.stats()["floor_waits"] == 1 and producer.pending() == []


def test_a_lowered_floor_releases_a_waiting_group(setup):
    engine, threads, producer = setup
    producer.grant([_group("g", 2)], floor=5)          # the update that floor assumed did not happen
    time.sleep(0.05)
    assert producer.stats()["running_groups"] == 0
    producer.lower_floor(0)
    assert [t.attempt for t in producer.take(["g@1"])] == [0, 1]


def test_an_episode_across_a_publication_keeps_each_tokens_version(setup, tokenizer):
    from hybridrl.envs.tasks import TaskInstance

    engine, threads, producer = setup
    slow = TaskInstance(task="calculator", task_id="slow", messages=({"role": "user", "content": "2 + 3? (take your time)"},),
                        reference="5", tools=("calculator",), metadata={})
    engine.abort_on_update = True              # the request in flight ends at the update, the agent continues it
    producer.grant([[(slow, 0, "slow@1")]], floor=0)

    async def update_mid_reply():               # on the engine's loop: nothing runs between the check and the update
        while not any(len(a.produced) > 3 for a in engine._active.values()):
            await asyncio.sleep(0.001)
        await engine.update_weights([], 1)

    threads.run(update_mid_reply(), timeout=60)
    [t] = producer.take(["slow@1"])
    v = t.policy_versions
    k = v.index(1)
    assert t.status == S.COMPLETED and 0 < k < len(v)
    assert v[:k] == [0] * k and v[k:] == [1] * (len(v) - k)          # two segments, never relabelled
    assert t.response_ids == list(tokenizer.encode(LONG, add_special_tokens=False)) + engine.eos_token_ids
