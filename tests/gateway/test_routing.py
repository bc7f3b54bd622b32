"""Routing episodes over replicas: sticky, least-loaded, a group's replica preferred."""

from __future__ import annotations

from collections import Counter

from hybridrl.agent.testing import ScriptedEngine, calculator_oracle
from hybridrl.gateway.routing import Replica, Router
from tests.gateway.helpers import cfg, gateway, run_agent
from tests.gateway.test_openai_client import tool_agent


def test_least_loaded_then_the_groups_replica():
    a, b = Replica(None, "a"), Replica(None, "b")
    router = Router([a, b], affinity_slack=1)
    assert router.place("g1") is a and router.place("g2") is b      # least loaded
    assert router.place("g1") is a                                  # g1's prefix is warm on a: 0 ahead
    assert router.place("g1") is a                                  # 1 ahead of the least loaded: within slack
    assert router.place("g1") is b                                  # 2 ahead: past the slack
    for _ in range(3):
        router.release(a, "g1")
    assert a.episodes == 0 and "g1" not in a.groups and router.place("g3") is a
    assert router.counts == {"placed": 6, "placed_with_group": 2}


def test_episodes_stick_to_one_replica_and_groups_share_one(tiny_tokenizer):
    engines = [ScriptedEngine(tiny_tokenizer, calculator_oracle(tiny_tokenizer, calls=2, call_format="json"))
               for _ in range(2)]
    trajs, runner = run_agent(engines, tiny_tokenizer, tool_agent, n=4, group_size=2,
                              agent_cfg=cfg(max_concurrent_episodes=64), gateway_cfg=gateway(prefix_affinity_slack=8))
    assert all(t.reward == 1.0 for t in trajs)
    where = {}
    for i, engine in enumerate(engines):
        for r in engine.requests:
            where.setdefault(r.request_id.rsplit("/", 1)[0], set()).add(i)
    assert len(where) == 8 and all(len(replicas) == 1 for replicas in where.values())     # sticky
    by_group = {}
    for episode, (replica,) in where.items():
        by_group.setdefault(episode.rsplit("/", 1)[0], set()).add(replica)
    assert all(len(r) == 1 for r in by_group.values())                                    # a group on one replica
    assert sorted(Counter(next(iter(r)) for r in by_group.values()).values()) == [2, 2]   # spread by load
