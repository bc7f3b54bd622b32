"""A verifiers environment (`task.name: verifiers`) on the real verifiers package: the shipped example's taskset
as instances, episodes through the agent loop (tokens exactly the engine's), the reward exactly what the
environment's own scoring gives the same conversation (a trace built here, independently), every reward in
the ledger, the eval taskset as validation, and the refusals at load. One module: importing verifiers is slow."""

from __future__ import annotations

import asyncio
import sys

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.tasks import get_task
from tests.envs.episodes import check_tokens, ledger_rewards, load_file, run_scripted
from tests.launch import ROOT

vf = pytest.importorskip("verifiers.v1", reason="pip install -e .[verifiers]")

ENV = f"{ROOT}/recipes/envs/vf_arith.py:load_environment"


def cfg(*extra):
    return load_config(None, ["task.name=verifiers", f"task.options.environment={ENV}",
                              "task.options.kwargs={num_tasks: 200}", "task.options.tools=[calculator]",
                              *extra]).task


@pytest.fixture(scope="module")
def example():
    return load_file(ENV.rpartition(":")[0], "vf_arith_test")


@pytest.fixture(scope="module")
def task():
    return get_task("verifiers", cfg())


def test_instances_are_the_tasksets_tasks_split_by_a_fixed_partition(task, example):
    train, val = task.train_split(1000), task.validation_split(1000)
    assert len(train) + len(val) == 200 and 5 <= len(val) <= 40
    assert not {i.task_id for i in train} & {i.task_id for i in val}
    rows = {t.key: t for t in example.load_environment(num_tasks=200)}
    for inst in train[:5] + val[:5]:
        row = rows[inst.metadata["key"]]
        assert inst.messages == ({"role": "user", "content": row.data.prompt},)
        assert inst.reference == row.data.answer and inst.tools == ("calculator",)
    again = get_task("verifiers", cfg())
    assert [i.task_id for i in again.validation_split(1000)] == [i.task_id for i in val]


def policy(inst, turn):
    k = int(inst.metadata["idx"])
    expr = inst.messages[-1]["content"].removeprefix("What is ").removesuffix("?")
    if k % 3 == 0 and turn == 0:
        return f"<calc>{expr}</calc>"
    return {0: f"<answer>{inst.reference}</answer>", 1: f"<answer>{inst.reference}x</answer>", 2: "no idea"}[k % 3]


def own_score(example, inst, messages):
    """The environment's own scoring of the conversation, on a trace built the way verifiers records one."""
    row = next(t for t in example.load_environment(num_tasks=200) if t.key == inst.metadata["key"])
    trace = vf.Trace(task=vf.TraceTask(type=type(row).__name__, data=row.data, key=row.key, hash=row.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    kinds = {"user": vf.UserMessage, "assistant": vf.AssistantMessage}
    for i, m in enumerate(messages):
        msg = vf.ToolMessage(tool_call_id=str(i), content=m["content"]) if m["role"] == "tool" \
            else kinds[m["role"]](content=m["content"])
        trace.nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=msg, sampled=m["role"] == "assistant"))
    asyncio.run(row.score(trace))
    return trace


def test_episodes_are_scored_by_the_environments_rewards(task, example, tokenizer, tmp_path):
    instances = task.train_split(1000)[:9]
    engine, trajectories = run_scripted(tokenizer, task, instances, policy)
    check_tokens(engine, trajectories)                           # the policy tokens are the engine's, exactly
    stored = ledger_rewards(tmp_path, trajectories)
    for inst, traj in zip(instances, trajectories):
        k = int(inst.metadata["idx"])
        chat = [*inst.messages]
        if k % 3 == 0:
            chat += [{"role": "assistant", "content": policy(inst, 0)}, {"role": "tool", "content": inst.reference}]
        if k % 3 != 2:
            chat.append({"role": "assistant", "content": policy(inst, 1)})
            assert traj.status == S.COMPLETED
            trace = own_score(example, inst, chat)
            assert traj.reward == pytest.approx(trace.reward)                    # the weighted sum
            assert traj.rewards == {n: r.score for n, r in trace.rewards.items()}
            assert traj.rewards["correct"] == float(k % 3 == 0) and traj.rewards["concise"] == 1.0
        else:
            assert traj.status == S.FAILED and traj.reward == 0.0
        assert stored[traj.trajectory_id] == traj.rewards                    # each reward a ledger component
        assert set(traj.reward_evaluators.values()) == {task.evaluator}
    assert {int(i.metadata["idx"]) % 3 for i in instances} == {0, 1, 2}


def test_the_eval_taskset_is_the_validation_split(example):
    task = get_task("verifiers", cfg("task.options.validation_kwargs={seed: 1, num_tasks: 20}"))
    val = task.validation_split(1000)
    assert sorted(i.metadata["key"] for i in val) == sorted(t.key for t in example.load_environment(num_tasks=20, seed=1))
    assert len(task.train_split(1000)) == 200 - len({i.metadata["key"] for i in val}
                                                    & {t.key for t in example.load_environment(num_tasks=200)})


@pytest.mark.parametrize("options, match", [
    (["task.options.validation_fraction=0.2"], "task.options.environment"),
    ([f"task.options.environment={ROOT}/recipes/envs/nope.py:load_environment"], "no file"),
    ([f"task.options.environment={ENV}", "task.options.kwargs={colour: red}"], "unexpected keyword"),
    ([f"task.options.environment={ROOT}/recipes/envs/vf_arith.py:ArithConfig"], "not a verifiers Taskset"),
    ([f"task.options.environment={ENV}", "task.options.validation_fraction=0"], "no validation"),
])
def test_bad_options_are_refused_at_load(options, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, ["task.name=verifiers", *options])


def test_without_the_package_the_recipe_is_refused_with_the_pip_command(monkeypatch):
    for name in [m for m in sys.modules if m == "verifiers" or m.startswith("verifiers.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ConfigError, match=r"pip install -e \.\[verifiers\]"):
        load_config(None, ["task.name=verifiers", f"task.options.environment={ENV}"])


def test_init_task_from_verifiers_scaffolds_an_environment_that_scores(tmp_path, monkeypatch):
    from hybridrl.data.episode import EpisodeOutcome
    from hybridrl.scaffold_envs import write_env

    monkeypatch.chdir(tmp_path)
    files = write_env("feet", tmp_path, "verifiers")
    cfg = load_config(files["grpo"])
    assert cfg.task.options["environment"] == "feet_env.py:load_environment"
    task = get_task("verifiers", cfg.task)
    inst = task.validation_split(1)[0]
    for text, want in ((f"<answer>{inst.reference}</answer>", 1.0), ("<answer>0</answer>", 0.0)):
        got = task.score(inst, EpisodeOutcome(answer=None, num_answers=0, final_text=text, completed=True))
        assert got.rewards == {"correct": want} and got.total == want


async def openai_agent(client, instance):
    """An agent written with the OpenAI client: one completion of the instance's prompt."""
    await client.chat.completions.create(model="policy", messages=list(instance.messages))


def test_episodes_through_the_gateway_are_scored_by_the_environments_rewards(task, example, tokenizer):
    """The same taskset with an OpenAI-client agent (the gateway front end): tokens exactly the engine's, the
    reward the environment's own scoring of the completion the agent got."""
    from hybridrl.agent.chat import ChatFormat
    from hybridrl.agent.config import AgentConfig
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.gateway.config import GatewayConfig
    from hybridrl.gateway.runner import GatewayRunner
    from tests.envs.episodes import RecordingEngine

    instances = task.validation_split(1000)[:4]
    chat = ChatFormat(tokenizer)
    prompts = [(chat.prompt_ids(list(i.messages)), i) for i in instances]

    def respond(ids, turn):
        inst = next(i for p, i in prompts if ids[:len(p)] == p)
        return f"<answer>{inst.reference}</answer>" if int(inst.metadata["idx"]) % 2 else "<answer>0</answer>"

    engine = RecordingEngine(tokenizer, respond, max_model_len=1 << 16)

    async def go():
        async with ToolBox([]) as tools:
            runner = GatewayRunner(engine, tokenizer, agent_cfg=AgentConfig(max_turns=2), gateway_cfg=GatewayConfig(),
                                   tools=tools, run_id="vf-gw", agent=openai_agent, server_thread=False)
            try:
                return await runner.run(instances, task=task)
            finally:
                await runner.close()

    trajectories = asyncio.run(go())
    check_tokens(engine, trajectories)
    for inst, traj in zip(instances, trajectories):
        chat_text = [*inst.messages, {"role": "assistant", "content": respond(chat.prompt_ids(list(inst.messages)), 0)}]
        trace = own_score(example, inst, chat_text)
        assert traj.status == S.COMPLETED and traj.reward == pytest.approx(trace.reward)
        assert traj.rewards == {n: r.score for n, r in trace.rewards.items()}
        assert traj.rewards["correct"] == float(int(inst.metadata["idx"]) % 2)
