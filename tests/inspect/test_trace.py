"""Trace events of the real agent loop (a scripted engine, real tools and environment), through the
ledger, answered by `hybridrl inspect`: each answer checked against what the script made happen."""

from __future__ import annotations

import asyncio
import json

import pytest

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.testing import ScriptedEngine, scripted_logprob
from hybridrl.agent.tools.base import ToolBox
from hybridrl.agent.tools.calculator import CalculatorTool
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.filters import filter_trajectories
from hybridrl.algo.groups import group_index_of
from hybridrl.algo.objective import compute_advantages
from hybridrl.data.trajectory import to_batch
from hybridrl.envs.tasks import TaskInstance, get_task
from hybridrl.inspect.cli import main as inspect_main
from hybridrl.inspect.query import RunLedger
from hybridrl.store.config import StoreConfig
from hybridrl.store.ledger import Ledger
from tests.agent.helpers import json_call, script


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models("qwen2"))


CALC_TURNS = ["<tool_call>{bad json}</tool_call>", json_call("python", code="1"),
              json_call("calculator", expression=123), "<calc>2 + 3</calc>", "<answer>5</answer>"]


def run_step(tmp_path, tokenizer):
    """One 'step': 2 calculator episodes (malformed, unauthorized, invalid, authorized calls, then an
    answer; one right, one wrong) and 2 guess-the-number episodes through the environment."""
    calc, guess = get_task("calculator"), get_task("guess_number")

    def responder(ids, turn):
        text = tokenizer.decode(ids)
        if "thinking of a whole number" in text:
            return ["<answer>50</answer>", "<answer>7</answer>"][min(turn, 1)]
        if "2 + 3" in text:
            return CALC_TURNS[min(turn, len(CALC_TURNS) - 1)]
        return "<answer>4</answer>"

    engine = ScriptedEngine(tokenizer, responder)
    runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(max_turns=8, max_response_tokens=1000),
                         tools=ToolBox([CalculatorTool()]), run_id="t")
    insts = [TaskInstance(task="calculator", task_id="c1", messages=({"role": "user", "content": "What is 2 + 3?"},),
                          reference="5", tools=("calculator",)),
             TaskInstance(task="calculator", task_id="c2", messages=({"role": "user", "content": "What is 1 + 2?"},),
                          reference="3", tools=("calculator",)),
             TaskInstance(task="guess_number", task_id="g1", reference="7",
                          messages=({"role": "user", "content": "I am thinking of a whole number from 1 to 100."},))]
    attempts = [(insts[0], 0, "c@1"), (insts[1], 1, "c@1"), (insts[2], 0, "g@1"), (insts[2], 1, "g@1")]
    trajs = asyncio.run(runner.run_attempts(attempts, task={"calculator": calc, "guess_number": guess}))
    algo = AlgoConfig(drop_all_equal_groups=True)
    kept = filter_trajectories(trajs, drop_truncated=True, drop_all_equal_groups=True)
    batch = to_batch(kept.kept)
    batch.set("old_logprobs", batch["behavior_logprobs"].clone())
    batch.set("advantages", compute_advantages(algo, batch["reward"], group_index_of(batch["group_id"]),
                                               batch["loss_mask"]))
    ledger = Ledger(tmp_path, StoreConfig(), tokenizer=tokenizer, algo=algo)
    ledger.record_step(1, trajectories=trajs, kept=kept, batch=batch, switch={}, rollout_version=0,
                       version_after=1, metrics={"time/step_s": 1.0})
    return engine, runner, trajs, batch


def test_each_trace_answer_matches_what_happened(tmp_path, tokenizer, capsys):
    engine, runner, trajs, batch = run_step(tmp_path, tokenizer)
    view = RunLedger(tmp_path)
    right, wrong, guess, _ = trajs
    e = view.explain(right.trajectory_id)

    # 1. policy and sampler: every token from v0 (the scripted engine's), each request with its seed
    mine = [r for r in engine.requests if r.request_id.startswith(right.trajectory_id + "/")]
    assert [q["request_id"] for q in e["policy"]["requests"]] == [r.request_id for r in mine]
    assert [q["seed"] for q in e["policy"]["requests"]] == [r.sampling.seed for r in mine]
    assert [q["tokens"] for q in e["policy"]["requests"]] == [len(r.output.token_ids) for r in mine]
    assert e["policy"]["by_version"] == {0: {"tokens": right.num_policy_tokens,
                                             "release": "the initial model (model.path), loaded by the engine at start"}}
    p = len(right.prompt_ids)
    assert e["tokens"]["behavior_logprobs"] == pytest.approx(
        [scripted_logprob(p + i, tok) if m else 0.0 for i, (tok, m) in enumerate(zip(right.response_ids,
                                                                                      right.response_mask))], abs=1e-6)
    # 2. timings: one entry per turn, and the turns' generate time adds up to the episode's
    turns = e["timings"]["turns"]
    assert [t["turn"] for t in turns] == list(range(5)) and right.turns == 5
    assert sum(t["generate_s"] for t in turns) == pytest.approx(right.timings["generate_s"])
    assert sum(t["tool_s"] for t in turns) == pytest.approx(right.timings["tool_s"])
    # 3. parser / authorizer: exactly the script's five turns
    decisions = [[d["decision"] for d in a["decisions"]] for a in e["actions"]]
    assert decisions == [["malformed"], ["unauthorized"], ["invalid_arguments"], ["authorized"], []]
    assert e["actions"][4]["parsed"]["answer"] and not e["actions"][0]["parsed"]["answer"]
    assert "not available" in e["actions"][1]["decisions"][0]["message"]
    # 4. side effects: the one calculator call that ran, and no environment here
    assert [(s["turn"], s["tool"], s["ok"]) for s in e["environment"]["side_effects"]] == [(3, "calculator", True)]
    assert e["environment"]["env_steps"] == [] and len(e["environment"]["observations"]) == 4
    g = view.explain(guess.trajectory_id)
    assert [(s["turn"], s["reward"], s["done"]) for s in g["environment"]["env_steps"]] == [(0, 0.0, False),
                                                                                           (1, 1.0, True)]
    # 5. reward components and evaluators
    assert e["reward"]["components"]["correct"] == {"value": 1.0, "evaluator": right.reward_evaluators["correct"]}
    assert g["reward"]["components"] == {"found": {"value": 1.0, "evaluator": "guess_number_env@1"}}
    # 6. advantage: calculator group (1.0 vs the wrong answer's) admitted; the guess group is all equal
    row = batch["trajectory_id"].index(right.trajectory_id)
    first = p + right.response_mask.index(1)
    assert e["advantage"]["value"] == pytest.approx(batch["advantages"][row, first].item()) and e["advantage"]["value"] > 0
    assert e["advantage"]["group_rewards"] == [right.reward, wrong.reward] and right.reward > wrong.reward
    # 7. update and 8. checkpoint
    assert e["update"]["consumed"] and e["update"]["step"] == 1 and e["update"]["batch_row"] == row
    assert g["update"] == {"consumed": False, "filter_reason": "all_equal_group"}
    assert e["checkpoint"]["checkpoint"] is None and e["checkpoint"]["release"] is None

    # the CLI: filters, human-readable and --json
    assert inspect_main(_args(tmp_path, tool_errors=True, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["id"] == right.trajectory_id       # one match: its answers
    assert inspect_main(_args(tmp_path, step=1, json=True)) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["matches"] == 4 and [r["id"] for r in listed["trajectories"]] == [t.trajectory_id for t in trajs]
    assert inspect_main(_args(tmp_path, reward=0.0)) == 0          # one match: the answers, in words
    text = capsys.readouterr().out
    assert text.startswith(f"trajectory {wrong.trajectory_id}") and "7. update: step 1" in text
    assert inspect_main(_args(tmp_path, trajectory=right.trace_id)) == 0
    text = capsys.readouterr().out
    assert "python: unauthorized" in text and "ran calculator (ok" in text and "correct 1 from" in text
    assert inspect_main(_args(tmp_path, trajectory="nope")) == 2
    assert "no trajectory 'nope'" in capsys.readouterr().err


def _args(run_dir, **kw):
    import argparse

    from hybridrl.inspect.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    argv = [str(run_dir)] + ([kw.pop("trajectory")] if "trajectory" in kw else [])
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return p.parse_args(argv)
