"""An RL job whose episodes are an OpenAI-client agent's, through the gateway, with real ranks: two CPU
ranks (colocated: each rank's engine behind its own gateway), the tiny recipe with `task.agent`, two
steps and a validation before and after. Read back from the run: every episode ran through the gateway
(no agent errors), every trajectory is one rendering of the agent's final conversation with only the
sampled tokens trained, the captured logprobs are what the trainer recomputes, the policy moved and the
counters the metrics report are the trajectories' own."""

from __future__ import annotations

import json

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train

AGENT = "tests.gateway.rl_agent:run"
pytestmark = pytest.mark.slow            # one 2-rank RL run: ~2-4 minutes on a busy 2-core machine


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_models):
    model = tiny_models("qwen2", init_std=0.05)
    run_dir = tmp_path_factory.mktemp("gateway-rl")
    proc = hybridrl_train(RECIPE, f"model.path={model}", f"run.dir={run_dir}", f"task.agent={AGENT}",
                          "gateway.tool_parser=none", "gateway.reasoning_parser=none", "trainer.validate_every=2",
                          "distributed.heartbeat_timeout_s=120")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return run_dir, model


def _shards(run_dir):
    import pyarrow.parquet as pq

    return {int(p.stem.split("_")[1]): pq.read_table(p).to_pylist()
            for p in sorted((run_dir / "ledger" / "data").glob("step_*.parquet"))}


def test_the_steps_ran_the_agent_through_the_gateway_and_trained(run):
    run_dir, _ = run
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["episodes"] == 16 and r["agent/episodes"] == 16 and r["agent/agent_errors"] == 0, r
        assert r["agent/tool_calls"] == 16 and r["tokens/admitted"] > 0
        assert r["mismatch/max_abs"] < 1e-4           # the gateway's captured logprobs are what the trainer scores
        assert r["policy/version"] == r["step"] and r["train/updated"] == 1
    for r in (rows[0], rows[2]):                      # validation ran through the gateway too
        assert r["val/episodes"] == 8 and r["val/agent/episodes"] == 8 and r["val/agent/agent_errors"] == 0
    assert rows[2]["parity/max_abs"] < 1e-4           # v1 reached the engines behind the gateways


def test_each_trajectory_is_one_rendering_of_the_agents_conversation(run):
    from transformers import AutoTokenizer

    run_dir, model = run
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    shards = _shards(run_dir)
    assert sorted(shards) == [1, 2]
    clean = 0
    for step, trajs in shards.items():
        assert len(trajs) == 16
        drift = {k: sum(json.loads(t["metadata"])[k] for t in trajs) for k in ("template_drift", "token_drift")}
        assert drift == {k: rows[step][f"agent/{k}"] for k in drift}     # counted, never silent
        for t in trajs:
            meta = json.loads(t["metadata"])
            assert t["status"] in ("completed", "truncated"), meta
            mask, ids = t["response_mask"], t["prompt_ids"] + t["response_ids"]
            runs = "".join(map(str, mask)).split("0")
            assert len([r for r in runs if r]) == 2, mask                # policy, tool result (untrained), policy
            assert all(lp <= 0 for lp, m in zip(t["behavior_logprobs"], mask) if m)
            assert set(t["policy_versions"][i] for i, m in enumerate(mask) if m) == {step - 1}
            if meta["template_drift"] or t["status"] != "completed":
                continue
            clean += 1
            rendered = tokenizer.apply_chat_template(meta["agent"]["messages"], tokenize=False)
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert rendered.startswith(text) and len(rendered) - len(text) <= len("<|im_end|>\n"), (rendered, text)
            if not meta["token_drift"]:
                assert tokenizer.encode(rendered, add_special_tokens=False)[:len(t["prompt_ids"])] == t["prompt_ids"]
    assert clean >= 16, clean                        # the comparison above ran on most trajectories



def test_plan_and_cost_read_the_agent_run(run):
    """`hybridrl plan` and `hybridrl cost` on a task.agent run (its episodes have no per-turn trace): a plan, not a
    traceback."""
    import subprocess
    import sys

    from tests.launch import ROOT, env_with_repo

    run_dir, _ = run
    out = {}
    for cmd in (["plan", str(run_dir), "--steps", "6"], ["cost", str(run_dir)]):
        proc = subprocess.run([sys.executable, "-m", "hybridrl", *cmd], cwd=ROOT, env=env_with_repo(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        out[cmd[0]] = proc.stdout
    assert "recommended:" in out["plan"] and "no per-turn trace" in out["plan"]
    assert "device-hours" in out["cost"]


def test_two_runs_of_an_openai_client_agent_under_load_are_the_same_run(tmp_path, tiny_models):
    """The agent's requests reach the engine over HTTP, on the engine's loop: what shares a batch (and so the
    last bits of the logprobs the update reads) must follow from the events, not from a worker thread (the
    client's platform lookup) or a clock (idle connections expiring). Two runs at once beside busy loops: every
    logged number but timings and the final weights equal (before: 24 numbers and 19 tensors differed)."""
    from tests.controller.test_determinism import two_runs_under_load
    from tests.controller.test_rl_e2e import assert_same_run

    model = tiny_models("qwen2", init_std=0.05)
    a, b = two_runs_under_load(tmp_path, [f"model.path={model}", f"task.agent={AGENT}",
                                          "gateway.tool_parser=none", "gateway.reasoning_parser=none",
                                          "trainer.total_steps=4", "trainer.validate_every=2",
                                          "distributed.heartbeat_timeout_s=120"])
    assert_same_run(a, b, from_step=0)
