"""`hybridrl inspect` on a gateway episode (an OpenAI-client agent that makes two tool calls) answers as it
does for the built-in loop's: each engine request, the turns the gateway parsed with their calls, the tools
the agent ran, the episode's text turn by turn (the policy's and the tool messages' between them)."""

from __future__ import annotations

import argparse
import re

from hybridrl.agent.testing import ScriptedEngine, calculator_oracle
from hybridrl.algo.config import AlgoConfig
from hybridrl.algo.filters import filter_trajectories
from hybridrl.data.trajectory import to_batch
from hybridrl.inspect.cli import main as inspect_main
from hybridrl.inspect.query import RunLedger
from hybridrl.store.config import StoreConfig
from hybridrl.store.ledger import Ledger
from tests.gateway.helpers import run_agent
from tests.gateway.test_openai_client import tool_agent


def test_inspect_shows_a_gateway_episode_turn_by_turn(tmp_path, tiny_tokenizer, capsys):
    engine = ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=2, call_format="json"))
    trajs, _ = run_agent(engine, tiny_tokenizer, tool_agent, n=1)
    t = trajs[0]
    kept = filter_trajectories(trajs, drop_truncated=True, drop_all_equal_groups=False)
    batch = to_batch(kept.kept)
    batch.set("old_logprobs", batch["behavior_logprobs"].clone())
    batch.set("advantages", batch["reward"][:, None].expand_as(batch["loss_mask"]).clone())
    Ledger(tmp_path, StoreConfig(), tokenizer=tiny_tokenizer, algo=AlgoConfig()).record_step(
        1, trajectories=trajs, kept=kept, batch=batch, switch={}, rollout_version=0, version_after=1,
        metrics={"time/step_s": 1.0})

    e = RunLedger(tmp_path).explain(t.trajectory_id)
    mine = [r for r in engine.requests if r.request_id.startswith(t.trajectory_id + "/")]
    assert [q["request_id"] for q in e["policy"]["requests"]] == [r.request_id for r in mine]
    assert [q["tokens"] for q in e["policy"]["requests"]] == [len(r.output.token_ids) for r in mine]
    assert [(a["turn"], a["parsed"]["calls"], a["parsed"]["errors"]) for a in e["actions"]] == [(0, 1, 0), (1, 1, 0),
                                                                                                 (2, 0, 0)]
    assert [(s["turn"], s["tool"], s["ok"]) for s in e["environment"]["side_effects"]] == [(0, "calculator", True),
                                                                                          (1, "calculator", True)]
    assert [o["roles"] for o in e["environment"]["observations"]] == [["tool"], ["tool"]]
    spans = [(s["kind"], s["start"], s["end"]) for s in e["spans"]]
    generated = [(s, end) for kind, s, end in spans if kind == "generate"]
    assert [end - s for s, end in generated] == [len(r.output.token_ids) for r in mine]
    assert all(all(t.response_mask[s:end]) for s, end in generated)        # the spans are the trained tokens

    inspect_main(argparse.Namespace(run_dir=str(tmp_path), trajectory=t.trajectory_id, step=None, failed=False,
                                    tool_errors=False, lagged=False, reward=None, limit=50, json=False, html=None,
                                    episodes=12, timeline=False, steps=None, out=None))
    text = capsys.readouterr().out
    assert "no turn was parsed" not in text and "0 tool executions" not in text
    assert "4. environment: 0 transitions, 2 tool executions (2 tool results in the conversation)" in text
    episode = text[text.index("episode:"): text.index("1. policy and sampler")]
    blocks = [b for b in re.split(r"\n  (?=\S)", episode) if b.startswith("turn ")]
    assert [("policy" if "the policy" in b else "tool") for b in blocks] == ["policy", "tool", "policy", "tool",
                                                                              "policy"]
    assert '"calculator"' in blocks[0] and "<answer>" in blocks[4]
