"""Collection modes: the group rules (pure), and a partial-rollout RL run end to end with real ranks."""

from __future__ import annotations

import json

import pytest

from hybridrl.controller.collection import informative_groups, stale_groups
from hybridrl.data.trajectory import Trajectory
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.test_rl_e2e import RECIPE, hybridrl_train


def _traj(group: str, attempt: int, reward: float, versions: list[int]) -> Trajectory:
    t = Trajectory(run_id="r", task_id=group, group_id=group, attempt=attempt, prompt_ids=[1], reward=reward)
    for v in versions:
        t.append([5], policy=True, logprobs=[-1.0], version=v)
    t.append([6], policy=False)
    return t


def test_informative_and_stale_groups():
    ts = [_traj("a", 0, 1.0, [3]), _traj("a", 1, 0.0, [3]),          # informative, fresh
          _traj("b", 0, 1.0, [1, 3]), _traj("b", 1, 1.0, [3]),       # all equal; one member started at v1
          _traj("c", 0, 0.0, [2]), _traj("c", 1, 0.5, [2, 3])]
    assert informative_groups(ts) == {"a", "c"}
    assert stale_groups(ts, version=3, max_lag=1) == {"b"}           # v1 < 3 - 1
    assert stale_groups(ts, version=3, max_lag=0) == {"b", "c"}
    assert stale_groups(ts, version=3, max_lag=2) == set()


@pytest.mark.slow
def test_partial_rollout_run_continues_requeues_and_trains(tmp_path, tiny_models):
    model = tiny_models("qwen2", init_std=0.05)
    proc = hybridrl_train(RECIPE, f"model.path={model}", f"run.dir={tmp_path}", "trainer.rollout_mode=partial",
                          "trainer.oversample=2", "trainer.prompts_per_step=2", "trainer.total_steps=4",
                          "trainer.rollout_deadline_s=0.01", "algo.max_policy_lag=0", "algo.stale=requeue")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in read_metrics(tmp_path) if r["step"] > 0]
    assert len(rows) == 4 and all(r["train/updated"] == 1.0 for r in rows)
    # lag 0 with requeue: a group that crossed an update leaves its step (and comes back fresh), so no
    # admitted trajectory holds two versions and the filter never sees a stale one
    assert all(r["partial/multi_version_episodes"] == 0 and r["policy/lag_max"] == 0 for r in rows)
    assert all(r["filter/policy_lag"] == 0 for r in rows)
    assert all(r["lag/0"] == r["episodes"] and r["lag/1"] == r["lag/2"] == r["lag/3+"] == 0 for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models("qwen2"))


class _Stream:
    def __init__(self, instances):
        self.items, self.drawn = list(instances), 0

    def next(self, n):
        out = self.items[self.drawn:self.drawn + n]
        self.drawn += n
        return out


class _OneEngineGroup:
    """The controller's side of `RolloutSide.collect` on one in-process rank: the real collector on a
    scripted engine (the RL worker needs torchrun; the collector and the bookkeeping do not)."""

    world_size = 1

    def __init__(self, collector):
        self.collector = collector

    def call(self, method, *, episodes, quorum, deadline_s, poll_s, informative_only):
        from hybridrl.envs.tasks import TaskInstance

        attempts = [(TaskInstance.from_dict(e["instance"]), e["attempt"], e["group_id"]) for e in episodes]
        out, stats = self.collector.collect(attempts, quorum=quorum, deadline_s=deadline_s, poll_s=poll_s,
                                            informative_only=informative_only)
        return [{"trajectories": out, "stats": stats.to_dict()}]


def test_a_stale_group_leaves_its_step_whole_and_its_prompt_is_launched_again(tokenizer, tmp_path):
    import asyncio  # noqa: F401
    from types import SimpleNamespace

    from hybridrl.algo.config import AlgoConfig
    from hybridrl.controller.collection import PartialCollection
    from hybridrl.controller.config import TrainerConfig
    from hybridrl.envs.tasks import TaskInstance
    from tests.agent.test_collector import _instance, _setup

    engine, loop, collector = _setup(tokenizer)
    slow = TaskInstance(task="calculator", task_id="slow", reference="5", tools=("calculator",), metadata={},
                        messages=({"role": "user", "content": "2 + 3? (take your time)"},))
    fast = [_instance(f"fast{i}") for i in range(40)]
    cfg = SimpleNamespace(trainer=TrainerConfig(rollout_mode="partial", prompts_per_step=1, group_size=1,
                                                oversample=2.0, collect_poll_s=0.01),
                          algo=AlgoConfig(max_policy_lag=0, stale="requeue"), run=SimpleNamespace(dir=str(tmp_path)))
    run = SimpleNamespace(version=0, stream=_Stream([slow, *fast]), collection={})
    collection = PartialCollection(cfg, _OneEngineGroup(collector), run)
    admitted, requeued = [], 0
    try:
        for step in range(1, 25):   # the slow reply (75 tokens) gets about 4 tokens a step
            trajectories, metrics = collection.rollout(step)
            admitted += [(t.group_id, sorted(t.versions)) for t in trajectories]
            requeued += metrics["stale/requeued_groups"]
            run.version += 1
            loop.run_until_complete(engine.update_weights([], run.version))   # a new version each step
    finally:
        collector.close()
        loop.close()
    # the slow episode needs several steps: it ends holding several versions, so at lag 0 its group
    # leaves the step whole and the same prompt is launched again, from scratch (no new prompt drawn)
    assert requeued >= 1
    assert all(len(v) == 1 for _, v in admitted) and len(admitted) >= 23
    relaunched = [g for g in list(collection.in_flight) + [g for g, _ in admitted] if g.startswith("slow@")]
    assert relaunched and all(g.endswith("r") for g in relaunched)
    assert run.stream.drawn == 1 + sum(1 for g, _ in admitted if g.startswith("fast")) + sum(
        1 for g in collection.in_flight if g.startswith("fast"))


@pytest.mark.slow
def test_kill_9_then_resume_trains_every_drawn_prompt_exactly_once(tmp_path, tiny_models):
    from tests.controller.resume_checks import assert_every_drawn_prompt_trained_once, kill_after_checkpoint

    model = tiny_models("qwen2", init_std=0.05)
    common = [f"model.path={model}", f"run.dir={tmp_path}", "trainer.rollout_mode=partial", "trainer.oversample=2",
              "trainer.prompts_per_step=2", "trainer.quorum=1", "trainer.total_steps=5", "trainer.checkpoint_every=2",
              "trainer.collect_poll_s=0.001"]
    state = kill_after_checkpoint(RECIPE, common, tmp_path, step=2)
    proc = hybridrl_train(RECIPE, *common, "trainer.resume=auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_every_drawn_prompt_trained_once(tmp_path, 5, held=set(state["collection"]["in_flight"]))


@pytest.mark.parametrize("policy", ["block", "drop_oldest"])
def test_queued_groups_wait_within_the_bound_and_none_is_lost_uncounted(tokenizer, tmp_path, policy):
    from types import SimpleNamespace

    from hybridrl.algo.config import AlgoConfig
    from hybridrl.controller.collection import PartialCollection
    from hybridrl.controller.config import TrainerConfig
    from tests.agent.test_collector import _instance, _setup

    engine, loop, collector = _setup(tokenizer)
    cfg = SimpleNamespace(trainer=TrainerConfig(rollout_mode="partial", prompts_per_step=1, group_size=1,
                                                oversample=4.0, collect_poll_s=0.01, max_groups_per_step=1,
                                                queue_max_groups=2, queue_policy=policy),
                          algo=AlgoConfig(), run=SimpleNamespace(dir=str(tmp_path)))
    run = SimpleNamespace(version=0, stream=_Stream([_instance(f"q{i}") for i in range(100)]), collection={})
    collection = PartialCollection(cfg, _OneEngineGroup(collector), run)
    trained, dropped = [], 0
    try:
        for step in range(1, 7):
            trajectories, metrics = collection.rollout(step)
            assert len({t.group_id for t in trajectories}) <= 1                 # max_groups_per_step
            assert metrics["queue/groups"] <= 2
            if policy == "block":                                               # launches left room
                assert len(collection.in_flight) + len(collection.queue) <= 2
            trained += [t.task_id for t in trajectories]
            dropped += metrics["queue/dropped_groups"]
            run.version += 1
            loop.run_until_complete(engine.update_weights([], run.version))
    finally:
        collector.close()
        loop.close()
    assert len(trained) == len(set(trained)) == 6
    held = len(collection.queue) + len(collection.in_flight)
    assert run.stream.drawn == len(trained) + held + dropped            # every drawn prompt accounted for
    if policy == "block":
        assert dropped == 0 and collection.blocked_launches > 0
    else:
        assert dropped > 0
