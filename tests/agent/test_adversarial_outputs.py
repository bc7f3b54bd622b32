"""Adversarial model outputs through the real agent loop: whatever the policy writes, its episode is
scored (a tool error it sees, a wrong answer), never INFRA_INVALID, which would take it out of its
group's baseline and let the policy dodge its reward.

Each case is a scripted policy (`ScriptedEngine`) run by `AgentRunner` with the real tools (the
calculator in process, the Python tool in its sandbox) and the real tasks (calculator, guess_number
with its environment); the episodes are then recorded by the run ledger, as a training step would.
(A tool program signalling the sandbox's pid 1 is the sandbox's own test.)"""

from __future__ import annotations

import asyncio

import pytest

from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.testing import ScriptedEngine
from hybridrl.agent.tools.base import ToolBox
from hybridrl.agent.tools.calculator import CalculatorTool
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.data.trajectory import to_batch
from hybridrl.envs.tasks import TaskInstance, get_task
from tests.agent.helpers import EchoTool, json_call

CALC = get_task("calculator")
GUESS = get_task("guess_number")
HUGE = "9" * 5000                                   # past Python's int-string limit (4300 digits)
DEEP = 20_000                                       # [ or { deep: far past the recursion limit


def byte_tokens(tokenizer, data: bytes) -> list[int]:
    """Token ids of raw bytes (byte-level BPE): invalid UTF-8 as a model can emit it."""
    table = {b: chr(c) for b, c in zip(*_byte_map())}
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in data] + [tokenizer.eos_token_id]


def _byte_map():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return bs, cs


# (name, turns): each turn is text or a callable(tokenizer) -> ids; the last turn repeats
CASES = [
    ("deep_json_array", ["<tool_call>" + "[" * DEEP + "</tool_call>", "<answer>5</answer>"]),
    ("deep_json_object", ['<tool_call>{"name": "calculator", "arguments": ' + '{"a": ' * 5000 + "1" + "}" * 5000
                          + "}</tool_call>", "<answer>5</answer>"]),
    ("deep_arguments_string", ['<tool_call>{"name": "calculator", "arguments": "' + "[" * DEEP + '"}</tool_call>',
                               "<answer>5</answer>"]),
    ("huge_int_argument", ['<tool_call>{"name": "calculator", "arguments": {"expression": ' + HUGE + "}}</tool_call>",
                           "<answer>5</answer>"]),
    ("huge_int_in_arguments_string", ['<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
                                      + HUGE + '}"}</tool_call>', "<answer>5</answer>"]),
    ("huge_expression", [f"<calc>{HUGE} * {HUGE}</calc>", "<answer>5</answer>"]),
    ("deep_expression", ["<calc>" + "(" * 120 + "1" + ")" * 120 + "</calc>", "<calc>" + "-" * 250 + "1</calc>",
                         "<calc>" + "2^" * 120 + "2</calc>", "<calc>9^9^9^9</calc>", "<answer>5</answer>"]),
    ("huge_answer", [f"<answer>{HUGE}</answer>"]),
    ("huge_negative_decimal_answer", [f"<answer>-{HUGE}.{HUGE}</answer>"]),
    ("nul_everywhere", ["<calc>2\x00+3</calc>", json_call("calculator", expression="2+3\x00"),
                        json_call("calc\x00ulator", expression="1"), "<answer>5\x00</answer>"]),
    ("lone_surrogates", ['<tool_call>{"name": "calculator", "arguments": {"expression": "\\ud800"}}</tool_call>',
                         '<tool_call>{"name": "\\udfff", "arguments": {}}</tool_call>',
                         '<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}</tool_call>',
                         "<answer>5</answer>"]),
    ("invalid_utf8", [lambda tok: byte_tokens(tok, b"<calc>2+\xff\xfe3</calc>"),
                      lambda tok: byte_tokens(tok, b"<answer>\xc3</answer>")]),
    ("oversized_arguments", [json_call("calculator", expression="1+" * 10_000 + "1"),
                             json_call("calculator", expression="1", **{"k" * 10_000: 1}),
                             "<calc>" + "(" * 10_000 + "1" + ")" * 10_000 + "</calc>", "<answer>5</answer>"]),
    ("unknown_tools", [json_call("rm -rf /"), json_call("x" * 10_000), json_call("calculator\n", expression="1"),
                       '<tool_call>{"name": 7}</tool_call>', '<tool_call>{"name": "calculator", "arguments": [1]}'
                       '</tool_call>', "<answer>5</answer>"]),
    ("unclosed_and_empty", ["<tool_call>", "<tool_call></tool_call>", "<calc></calc>", "<answer></answer>"]),
]

PYTHON_CASES = [
    ("python_nul_and_surrogates", [json_call("python", code="print(1)\x00"),
                                   '<tool_call>{"name": "python", "arguments": {"code": "print(\\"\\ud800\\")"}}'
                                   '</tool_call>', "<answer>5</answer>"]),
    ("python_deep_and_huge", [json_call("python", code="(" * 5000 + ")" * 5000),
                              json_call("python", code=f"print(int('{HUGE}'))"),
                              json_call("python", code="x" * 9000), "<answer>5</answer>"]),
]

GUESS_CASES = [
    ("guess_huge", [f"<answer>{HUGE}</answer>", f"<answer>-{HUGE}</answer>", "<answer>1e999</answer>",
                    "<answer>\x00</answer>", "<answer>50</answer>"]),
]


def scripted(tokenizer, turns):
    def respond(ids, turn):
        t = turns[min(turn, len(turns) - 1)]
        return t(tokenizer) if callable(t) else t
    return respond


def calc_instance(task_id: str, tools=("calculator", "echo")) -> TaskInstance:
    return TaskInstance(task="calculator", task_id=task_id, messages=({"role": "user", "content": "What is 2 + 3?"},),
                        reference="5", tools=tuple(tools), metadata={"expression": "2 + 3"})


def run(tokenizer, cases, *, task, box, instance, max_turns=6):
    agent = AgentConfig(max_turns=max_turns, max_new_tokens_per_turn=60_000, max_response_tokens=400_000)

    async def go():
        out = []
        async with box:
            for name, turns in cases:
                engine = ScriptedEngine(tokenizer, scripted(tokenizer, turns), max_model_len=1 << 21)
                runner = AgentRunner(engine, tokenizer, agent_cfg=agent, tools=box, run_id="adv")
                out.append((name, (await runner.run([instance(name)], task=task))[0]))
        return out

    return asyncio.run(go())


def check(results, tmp_path):
    from hybridrl.algo.config import AlgoConfig
    from hybridrl.algo.filters import filter_trajectories
    from hybridrl.store.config import StoreConfig
    from hybridrl.store.ledger import Ledger

    for name, traj in results:
        assert traj.status != S.INFRA_INVALID, (name, traj.metadata.get("end_reason"))
        assert traj.status in (S.COMPLETED, S.FAILED, S.TRUNCATED), (name, traj.status)
        assert traj.reward_evaluators, name                           # scored
        traj.validate()
    trajectories = [t for _, t in results]
    kept = filter_trajectories(trajectories, drop_all_equal_groups=False)
    assert len(kept.kept) == len(trajectories)
    batch = to_batch(kept.kept)
    ledger = Ledger(tmp_path, StoreConfig(), algo=AlgoConfig())
    ledger.record_step(1, trajectories=trajectories, kept=kept, batch=batch, switch=None, rollout_version=0,
                       version_after=1, metrics={})


def test_adversarial_outputs_are_scored_never_infra(tokenizer, tmp_path):
    results = run(tokenizer, CASES, task=CALC, box=ToolBox([CalculatorTool(), EchoTool()]), instance=calc_instance)
    check(results, tmp_path)
    by_name = dict(results)
    assert by_name["huge_answer"].reward == 0.0 and by_name["huge_answer"].status == S.COMPLETED
    assert by_name["huge_answer"].rewards["format"] == 1.0          # a number literal, just not the answer
    errors = [c.error for c in by_name["deep_json_array"].tool_calls]
    assert errors and "nested" in errors[0]
    assert "digits" in by_name["huge_int_argument"].tool_calls[0].error
    assert by_name["lone_surrogates"].status == S.COMPLETED and by_name["lone_surrogates"].reward > 0
    assert all(not c.ok for c in by_name["unknown_tools"].tool_calls)


def test_adversarial_python_programs_are_tool_errors(tokenizer, tmp_path):
    box = ToolBox.from_config(ToolsConfig(pool_size=1, warm=0, timeout_s=20.0), names=["python"])
    results = run(tokenizer, PYTHON_CASES, task=CALC, box=box,
                  instance=lambda name: calc_instance(name, tools=("python",)))
    check(results, tmp_path)
    calls = {name: [(c.ok, c.error or "") for c in traj.tool_calls] for name, traj in results}
    assert [ok for ok, _ in calls["python_nul_and_surrogates"]] == [False, True]   # the surrogate became U+FFFD
    assert [ok for ok, _ in calls["python_deep_and_huge"]] == [False, False, False]
    assert calls["python_deep_and_huge"][2][1].startswith("invalid_arguments")     # over max_code_chars


def test_adversarial_guesses_in_an_environment(tokenizer, tmp_path):
    [inst] = GUESS.train_split(1, seed=0)
    inst = TaskInstance(task=inst.task, task_id="guess_huge", messages=inst.messages, reference="50", tools=())
    results = run(tokenizer, GUESS_CASES, task=GUESS, box=ToolBox([]), instance=lambda name: inst)
    check(results, tmp_path)
    [(_, traj)] = results
    assert traj.status == S.COMPLETED and traj.reward == 1.0 and traj.metadata["env_steps"] == 5


def test_a_huge_guess_leaves_a_serialisable_environment_state():
    import json

    [inst] = GUESS.train_split(1, seed=0)
    env = GUESS.make_env(inst)
    env.reset(inst, seed=0)
    assert env.step({"answer": HUGE}).observation == "lower"
    assert env.step({"answer": "-" + HUGE}).observation == "higher"
    state = json.loads(json.dumps(env.state_dict()))           # str(int) of 5000 digits would raise
    env.load_state_dict(state)
    assert env.step({"answer": inst.reference}).done
