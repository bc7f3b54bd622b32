"""The kill switch: its file stops every tool call in flight and every new one and new episode,
without the policy (the agent loop's engine keeps answering), and says so in the audit log."""

from __future__ import annotations

import asyncio
import os
import time

import psutil
import pytest

from hybridrl.agent import killswitch
from hybridrl.agent.actions import ToolCall
from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.testing import ScriptedEngine
from hybridrl.agent.tools.base import ToolBox
from hybridrl.data.episode import TaskInstance
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.tasks import get_task
from hybridrl.telemetry.audit import records, verify
from tests.agent.helpers import json_call, script

IN_FLIGHT = 32


def _tools(tmp_path, **kwargs) -> ToolsConfig:
    base = dict(pool_size=IN_FLIGHT, warm=0, timeout_s=600.0, cpu_s=600, memory_mb=128, max_processes=4,
                kill_switch=str(tmp_path / "kill-switch"), audit_log=str(tmp_path / "audit.jsonl"))
    return ToolsConfig(**{**base, **kwargs})


def test_the_kill_switch_stops_32_tool_calls_in_flight_within_a_second(tmp_path):
    cfg = _tools(tmp_path)
    sleeper = ToolCall("python", {"code": "import time\ntime.sleep(600)"}, "", "json")

    async def go():
        async with ToolBox.from_config(cfg, names=["python", "calculator"]) as box:
            pool = box.sandbox_pool()
            await pool.start()
            calls = [asyncio.ensure_future(box.call(sleeper, context={"episode": f"e{i}", "call": "t0.0"}))
                     for i in range(IN_FLIGHT)]
            # every tool process is running: each has joined its sandbox's cgroup (a fact of the kernel's)
            deadline = time.monotonic() + 300
            while sum(1 for s in list(pool._live) if s.cgroup is None or s.cgroup.pids()) < IN_FLIGHT:
                assert time.monotonic() < deadline and not any(c.done() for c in calls)
                await asyncio.sleep(0.05)
            uids = list(pool.uids)
            tripped = time.monotonic()
            killswitch.trip(cfg.kill_switch, "test: stop everything", audit_log=cfg.audit_log)
            results = await asyncio.gather(*calls)
            stopped_s = time.monotonic() - tripped
            after = await box.call(ToolCall("calculator", {"expression": "1+1"}, "", "json"))
            return results, stopped_s, after, uids, box.stats()

    results, stopped_s, after, uids, stats = asyncio.run(go())
    print(f"{IN_FLIGHT} calls stopped {stopped_s:.3f} s after the switch was set")
    assert stopped_s < 1.0, stopped_s
    assert all(r.infra_error and "kill switch" in r.error for r in results), [r.error for r in results][:3]
    assert after.infra_error and "kill switch" in after.error          # a later call of any tool: refused
    assert stats["killed"] == IN_FLIGHT + 1 and stats["sandbox"]["killed"] == IN_FLIGHT
    time.sleep(0.2)
    left = [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in uids]
    assert left == []
    log = list(records(tmp_path / "audit.jsonl"))
    kinds = [r["kind"] for r in log]
    assert kinds.count("kill_switch_set") == 1 and kinds.count("kill_switch") == 1
    assert sum(1 for r in log if r["kind"] == "sandbox_call" and r["killed"]) == IN_FLIGHT
    assert {r["episode"] for r in log if r["kind"] == "sandbox_call"} == {f"e{i}" for i in range(IN_FLIGHT)}
    assert verify(tmp_path / "audit.jsonl")[0]


def test_no_new_episode_starts_once_the_switch_is_set(tmp_path, tokenizer):
    """The engine (the policy) keeps answering; the episodes end ABORTED by the switch, never
    trained on, and no tool runs."""
    cfg = _tools(tmp_path, pool_size=1)
    killswitch.trip(cfg.kill_switch, "test: before the step")
    task = get_task("calculator")
    inst = TaskInstance(task="calculator", task_id="q1", messages=({"role": "user", "content": "What is 2 + 3?"},),
                        reference="5", tools=("python",), metadata={"expression": "2 + 3"})

    async def go():
        async with ToolBox.from_config(cfg, names=["python"]) as box:
            engine = ScriptedEngine(tokenizer, script(json_call("python", code="print(5)"), "<answer>5</answer>"))
            runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(), tools=box, run_id="r")
            return await runner.run([inst], task=task, group_size=3), engine, box.stats()

    trajs, engine, stats = asyncio.run(go())
    assert [t.status for t in trajs] == [S.ABORTED] * 3
    assert all("kill switch: test: before the step" in t.metadata["end_reason"] for t in trajs)
    assert engine.requests == [] and stats["calls"] == 0


def test_the_switch_command_sets_and_clears_it(tmp_path, capsys):
    from hybridrl.cli import main

    assert main(["agent", "kill-switch", str(tmp_path), "--reason", "reward hacking seen"]) == 0
    assert killswitch.read(tmp_path / "kill-switch")["reason"] == "reward hacking seen"
    assert main(["agent", "kill-switch", str(tmp_path), "--status"]) == 0
    assert "SET (reward hacking seen" in capsys.readouterr().out
    assert main(["agent", "kill-switch", str(tmp_path), "--clear"]) == 0
    assert not (tmp_path / "kill-switch").exists()
    assert [r["kind"] for r in records(tmp_path / "audit.jsonl")] == ["kill_switch_set", "kill_switch_cleared"]
    assert main(["agent", "kill-switch", str(tmp_path / "missing")]) == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="counting sandbox processes by uid needs root")
def test_a_tripped_pool_starts_no_warm_sandbox(tmp_path):
    cfg = _tools(tmp_path, pool_size=1, warm=2)

    async def go():
        async with ToolBox.from_config(cfg, names=["python"]) as box:
            pool = box.sandbox_pool()
            await pool.start()
            box.kill("test")
            await asyncio.sleep(0.3)
            return len(pool._warm), len(pool._live), await pool.run("print(1)")

    warm, live, refused = asyncio.run(go())
    assert live == 0 and refused.killed == "test" and not refused.ok
