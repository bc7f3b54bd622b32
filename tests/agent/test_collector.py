"""Partial rollouts on one engine: a step ends at a quorum, the slow episode is interrupted at a token
boundary, kept whole, and continues after a weight update with both versions' tokens kept."""

from __future__ import annotations

import asyncio
import time

from hybridrl.agent.collector import PartialCollector
from hybridrl.agent.config import AgentConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.testing import ScriptedEngine, scripted_logprob
from hybridrl.agent.tools.base import ToolBox
from hybridrl.agent.tools.calculator import CalculatorTool
from hybridrl.data.trajectory import TrajectoryStatus as S
from hybridrl.envs.tasks import TaskInstance, get_task

TASK = get_task("calculator")
LONG = "let me think " * 12 + "<answer>5</answer>"


def _instance(task_id: str) -> TaskInstance:
    return TaskInstance(task="calculator", task_id=task_id, messages=({"role": "user", "content": "2 + 3?"},),
                        reference="5", tools=("calculator",), metadata={"expression": "2 + 3"})


def _setup(tokenizer, **agent):
    def respond(ids, turn):
        return LONG if "take your time" in tokenizer.decode(ids) else "<answer>5</answer>"

    engine = ScriptedEngine(tokenizer, respond, step_latency_s=0.002)
    runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(max_new_tokens_per_turn=200, **agent),
                         tools=ToolBox([CalculatorTool()]), run_id="t")
    loop = asyncio.new_event_loop()
    collector = PartialCollector(runner, TASK, loop, group_size=1, sum_over_ranks=lambda v: v)
    return engine, loop, collector


def test_interrupted_episode_continues_on_the_new_version_with_both_segments(tokenizer):
    engine, loop, collector = _setup(tokenizer)
    fast, slow = _instance("fast"), TaskInstance(task="calculator", task_id="slow",
                                                 messages=({"role": "user", "content": "2 + 3? (take your time)"},),
                                                 reference="5", tools=("calculator",), metadata={})
    try:
        out, stats = collector.collect([(fast, 0, "fast@1"), (slow, 0, "slow@1")], quorum=1, poll_s=0.01)
        assert [t.group_id for t in out] == ["fast@1"] and out[0].status == S.COMPLETED
        assert stats.interrupted == 1 and stats.live == 1 and stats.stopped_by == "quorum"
        loop.run_until_complete(engine.update_weights([], 1))          # the next policy is published
        out2, stats2 = collector.collect([], quorum=1, poll_s=0.01)
    finally:
        collector.close()
        loop.close()
    [t] = out2
    assert t.group_id == "slow@1" and t.status == S.COMPLETED and t.reward == 1.0
    assert t.metadata["interruptions"] == 1
    # the whole reply, exactly once: the interruption lost and repeated nothing
    expected = list(tokenizer.encode(LONG, add_special_tokens=False)) + engine.eos_token_ids
    assert t.response_ids == expected
    v = t.policy_versions
    k = v.index(1)
    assert 0 < k < len(v) and v[:k] == [0] * k and v[k:] == [1] * (len(v) - k)    # both segments, in order
    p = len(t.prompt_ids)
    assert t.behavior_logprobs == [scripted_logprob(p + i, tok) for i, tok in enumerate(t.response_ids)]
    assert len(engine.requests) == 3          # fast, slow (interrupted), slow (continued)
    assert engine.requests[2].input_ids == t.prompt_ids + t.response_ids[:k]


def test_pause_does_not_spend_the_wall_clock_budget(tokenizer):
    engine, loop, collector = _setup(tokenizer, max_episode_s=0.8)
    slow = TaskInstance(task="calculator", task_id="slow", reference="5", tools=("calculator",), metadata={},
                        messages=({"role": "user", "content": "2 + 3? (take your time)"},))
    try:
        # a quorum of 1 over a single slow group: stop at the deadline instead, mid-episode
        out, stats = collector.collect([(slow, 0, "slow@1")], quorum=1, deadline_s=0.03, poll_s=0.01)
        assert out == [] and stats.stopped_by == "deadline" and stats.live == 1
        time.sleep(1.0)                        # "training": longer than the episode's whole budget
        out2, _ = collector.collect([], quorum=1, poll_s=0.01)
    finally:
        collector.close()
        loop.close()
    assert out2[0].status == S.COMPLETED and out2[0].metadata["interruptions"] == 1


def test_a_paused_episode_keeps_its_leased_environment_through_a_long_update(tokenizer, tmp_path, caplog):
    import logging
    import re

    from hybridrl.envs.client import LeasedEnvProvider
    from hybridrl.envs.config import EnvServiceConfig
    from hybridrl.envs.service import EnvService

    task = get_task("guess_number")

    def bisect(ids, turn):
        text = tokenizer.decode(ids)
        lo, hi = 1, 100
        for guess, hint in re.findall(r"<answer>(\d+)</answer><\|im_end\|>\n<\|im_start\|>user\n(\w+)", text):
            lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
        return f"<answer>{(lo + hi) // 2}</answer>"

    # The lease must outlive one turn (a generate and a step: ~0.1 s quiet, several times that on a
    # loaded machine); the update below outlives three leases.
    ttl = 2.0
    # synchronous=normal: no fsync per commit. With full, a renewal's commit stalled by another job's disk
    # writes (the suite's checkpoints) can outlast the lease, and that is not what is tested here
    svc = EnvService(tmp_path / "envs.sqlite", lease_ttl_s=ttl, synchronous="normal")
    engine = ScriptedEngine(tokenizer, bisect, step_latency_s=0.01)
    runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(max_turns=8), tools=ToolBox([]), run_id="r",
                         envs=LeasedEnvProvider(svc, EnvServiceConfig(db_path=str(svc.db_path), lease_ttl_s=ttl)))
    loop = asyncio.new_event_loop()
    collector = PartialCollector(runner, task, loop, group_size=1, sum_over_ranks=lambda v: v)
    [inst] = task.train_split(1, seed=0)
    caplog.set_level(logging.DEBUG, logger="hybridrl.agent.pause")
    try:
        out, stats = collector.collect([(inst, 0, "g@1")], quorum=1, deadline_s=0.05, poll_s=0.01)
        assert out == [] and stats.live == 1
        time.sleep(3.3 * ttl)                         # the update: over 3 lease lifetimes, nothing stepping
        out, _ = collector.collect([], quorum=1, poll_s=0.01)
    finally:
        collector.close()
        loop.close()
    [t] = out
    # if this fails, the keeper's passes (when, how many sessions it renewed) and the service's renewals say why
    renewals = svc.db.execute("SELECT time, detail FROM events WHERE kind = 'renew'").fetchall()
    why = {"metadata": t.metadata, "keeper": [f"{r.relativeCreated:.0f} ms {r.getMessage()}" for r in caplog.records],
           "renewals": [tuple(r) for r in renewals]}
    assert t.status == S.COMPLETED and t.reward == 1.0, why
    assert collector.gate.renewals >= 2
    assert [s for (s,) in svc.db.execute("SELECT status FROM episodes").fetchall()] == ["closed"]


def test_validation_runs_while_paused_episodes_would_hold_every_slot(tokenizer):
    """A paused episode gives its concurrency slot back: validation on the same runner (between the
    steps of a partial-rollout run) does not wait for episodes that wait for it."""
    engine, loop, collector = _setup(tokenizer, max_concurrent_episodes=1)
    slow = TaskInstance(task="calculator", task_id="slow", reference="5", tools=("calculator",), metadata={},
                        messages=({"role": "user", "content": "2 + 3? (take your time)"},))
    runner = collector.runner
    try:
        out, stats = collector.collect([(slow, 0, "slow@1")], quorum=1, deadline_s=0.03, poll_s=0.01)
        assert out == [] and stats.live == 1                  # paused, behind the closed gate
        validation = runner.run_attempts([(_instance("val"), 0, "val@0")], task=TASK, temperature=0.0)
        [val] = loop.run_until_complete(asyncio.wait_for(validation, timeout=60))
        assert val.status == S.COMPLETED and val.reward == 1.0
        out2, _ = collector.collect([], quorum=1, poll_s=0.01)
    finally:
        collector.close()
        loop.close()
    assert out2[0].status == S.COMPLETED and out2[0].metadata["interruptions"] == 1
    assert runner._slots._value == 1                          # every slot given back exactly once
