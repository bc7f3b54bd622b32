"""Task mixtures in partial rollouts: each task keeps its share of the groups a step trains on, even when one
task's environment is far slower, where a plain two-task stream lets the fast task's groups come first.

The collection is the real `PartialCollection` over the real `PartialCollector` and agent loop, in one
process (as tests/controller/test_collection.py drives it): a scripted engine answers calculator
questions at once and bisects guess_number (1..64, 32 prompts of each task); guess_number's environment
is a test double that sleeps `SLOW_ENV_S` per step (a guess episode takes up to 6 steps: far more than 10x
a calculator episode)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow     # three 10-step collections with a slow environment: ~4 min on a loaded 2-core machine

SLOW_ENV_S = 0.1
STEPS = 10
OVERSAMPLE = 4.0          # 16 groups in flight for a quorum of 4: room for the fast task to fill every step


class SlowEnvs:
    """The agent loop's environment provider, each step of every environment `delay_s` late (asleep, so
    other episodes go on meanwhile): a 10x slower environment."""

    def __init__(self, delay_s: float):
        from hybridrl.agent.env_sessions import LocalEnvProvider

        self.inner, self.delay_s = LocalEnvProvider(), delay_s

    def session(self, task, instance, *, seed, episode_key):
        session = self.inner.session(task, instance, seed=seed, episode_key=episode_key)
        if session is None:
            return None
        step, delay = session.step, self.delay_s

        async def slow_step(action):
            await asyncio.sleep(delay)
            return await step(action)

        session.step = slow_step
        return session


def _responder(tokenizer):
    from hybridrl.envs.arithmetic import evaluate, format_value

    def respond(ids, turn):
        text = tokenizer.decode(ids)
        question = re.search(r"What is (.+?)\?", text)
        if question:
            return f"<answer>{format_value(evaluate(question[1]))}</answer>"
        lo, hi = 1, 64
        for guess, hint in re.findall(r"<answer>(\d+)</answer><\|im_end\|>\n<\|im_start\|>user\n(\w+)", text):
            lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
        return f"<answer>{(lo + hi) // 2}</answer>"

    return respond


class _OneEngineGroup:
    world_size = 1

    def __init__(self, collector):
        self.collector = collector

    def call(self, method, *, episodes, quorum, deadline_s, poll_s, informative_only):
        from hybridrl.envs.tasks import TaskInstance

        attempts = [(TaskInstance.from_dict(e["instance"]), e["attempt"], e["group_id"]) for e in episodes]
        out, stats = self.collector.collect(attempts, quorum=quorum, deadline_s=deadline_s, poll_s=poll_s,
                                            informative_only=informative_only)
        return [{"trajectories": out, "stats": stats.to_dict()}]


def _run(tokenizer, tmp_path, *, policy: str | None):
    """10 partial steps of a calculator + guess_number (50/50) mixture; `policy` None: today's collection
    (one ShuffledStream over both tasks' prompts, no mixture). Returns per-step groups by task, metrics."""
    from hybridrl.agent.collector import PartialCollector
    from hybridrl.agent.config import AgentConfig
    from hybridrl.agent.loop import AgentRunner
    from hybridrl.agent.testing import ScriptedEngine
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.algo.config import AlgoConfig
    from hybridrl.controller.collection import PartialCollection, admitted
    from hybridrl.controller.config import TrainerConfig
    from hybridrl.controller.curriculum import after_admission, training_stream
    from hybridrl.data.stream import ShuffledStream
    from hybridrl.envs.config import TaskConfig
    from hybridrl.envs.tasks import get_task

    task_cfg = TaskConfig(name="mixture", train_size=32, share_policy=policy or "none", mixture=[
        {"name": "calculator", "weight": 1.0}, {"name": "guess_number", "weight": 1.0, "options": {"max_value": 64}}])
    mixture = get_task("mixture", task_cfg)
    cfg = SimpleNamespace(trainer=TrainerConfig(rollout_mode="partial", prompts_per_step=4, group_size=2,
                                                oversample=OVERSAMPLE, collect_poll_s=0.01),
                          algo=AlgoConfig(drop_all_equal_groups=False),    # every episode scores 1.0
                          agent=SimpleNamespace(max_response_tokens=240), run=SimpleNamespace(dir=str(tmp_path), seed=0), task=task_cfg)
    if policy is None:
        stream = ShuffledStream(mixture.train_split(), seed=0)
    else:
        stream = training_stream(cfg, mixture)
    engine = ScriptedEngine(tokenizer, _responder(tokenizer), step_latency_s=0.001)
    runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(max_turns=6, max_new_tokens_per_turn=40),
                         tools=ToolBox([]), run_id="mix", envs=SlowEnvs(SLOW_ENV_S))
    loop = asyncio.new_event_loop()
    collector = PartialCollector(runner, mixture, loop, group_size=2, sum_over_ranks=lambda v: v)
    run = SimpleNamespace(version=0, stream=stream, collection={})
    collection = PartialCollection(cfg, _OneEngineGroup(collector), run)
    task_of = {inst.task_id: inst.task for inst in mixture.train_split()}
    per_step, rows = [], []
    try:
        for step in range(1, STEPS + 1):
            trajectories, metrics = collection.rollout(step)
            metrics.update(after_admission(cfg, stream, admitted(cfg, trajectories, 0).kept))   # as the trainer
            assert all(t.status.value == "completed" and t.reward == 1.0 for t in trajectories)
            per_step.append(Counter(task_of[g.split("@")[0]] for g in {t.group_id for t in trajectories}))
            rows.append(metrics)
    finally:
        collector.close()
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]     # environment steps still asleep
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending))
        loop.close()
    return per_step, rows


def _share(per_step, task="guess_number"):
    total = sum(sum(c.values()) for c in per_step)
    return sum(c[task] for c in per_step) / total


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models("qwen2"))


@pytest.fixture(scope="module")
def runs(tokenizer, tmp_path_factory):
    return {policy: _run(tokenizer, tmp_path_factory.mktemp(str(policy)), policy=policy)
            for policy in (None, "wait", "launch")}


def test_todays_collection_lets_the_fast_task_come_first(runs):
    per_step, _ = runs[None]
    print("today's collection (one stream over both tasks), groups per step:", [dict(c) for c in per_step],
          "slow task's share", round(_share(per_step), 3))
    # the first step trains only what completed first: the fast task's groups; over the run the slow
    # task stays below its half (its groups are the ones still in flight)
    assert per_step[0]["guess_number"] == 0 and per_step[0]["calculator"] > 0
    assert _share(per_step) < 0.5


def test_the_share_guarantee_holds_each_task_at_its_weight(runs):
    per_step, rows = runs["wait"]
    print("share_policy=wait, groups per step:", [dict(c) for c in per_step], "slow task's share",
          round(_share(per_step), 3), "wait rounds", [r["share/wait_rounds"] for r in rows], "held",
          [r["share/held_groups"] for r in rows])
    assert 0.45 <= _share(per_step) <= 0.55                     # 50/50 within +-10% of the declared share
    assert all(c == {"calculator": 2, "guess_number": 2} for c in per_step)     # each step: 2 + 2 of quorum 4
    assert sum(r["share/wait_rounds"] for r in rows) > 0         # the policy waited for the slow task, counted
    assert sum(r["share/held_groups"] for r in rows) > 0         # and held the fast task's extra groups
    assert max(r["share/held_groups"] for r in rows) <= 16       # bounded: the pipeline is capped per task
    assert all(r["share/outside_tolerance"] == 0.0 and r["share/short_groups"] == 0 for r in rows)
    last = rows[-1]
    assert last["task/guess_number/latency_s"] > last["task/calculator/latency_s"]
    assert last["task/calculator/success_rate"] == last["task/guess_number/success_rate"] == 1.0
    print("episode seconds: calculator", round(last["task/calculator/latency_s"], 3), "guess_number",
          round(last["task/guess_number/latency_s"], 3))


def test_launch_never_trains_a_task_over_its_share_and_counts_what_it_lacks(runs):
    per_step, rows = runs["launch"]
    print("share_policy=launch, groups per step:", [dict(c) for c in per_step], "slow task's share",
          round(_share(per_step), 3), "short", [r["share/short_groups"] for r in rows])
    assert all(c["calculator"] <= 2 and c["guess_number"] <= 2 for c in per_step)
    assert all(r["share/short_groups"] == 4 - sum(c.values()) for c, r in zip(per_step, rows))
    assert all(r["share/wait_rounds"] == 0 for r in rows)
