"""Routing episodes over the rollout engine replicas a gateway fronts.

- An episode sticks to the replica its first request went to (its KV prefix stays warm there).
- A new episode goes to the least-loaded replica (episodes placed, then requests in flight), except
  that a replica already serving another episode of its group (same prompt: the prefix cache holds it)
  is preferred while its load is within `affinity_slack` episodes of the least-loaded one.

One gateway runs on each rank that owns an engine and fronts the replicas of that rank; across ranks
the controller's dispatch keeps a group's episodes on one rank (`RolloutSide.rollout` splits episodes
by whole groups; `collect` grants group i to rollout rank i % R), so the same two rules hold there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass(eq=False)
class Replica:
    engine: Any
    name: str
    episodes: int = 0                 # episodes placed here and not yet ended
    in_flight: int = 0                # requests running
    served: int = 0
    groups: Counter = field(default_factory=Counter)

    @property
    def load(self) -> tuple[int, int]:
        return self.episodes, self.in_flight


class Router:
    def __init__(self, replicas: Sequence[Replica], *, affinity_slack: int = 8):
        if not replicas:
            raise ValueError("the router needs at least one replica")
        self.replicas = list(replicas)
        self.affinity_slack = affinity_slack
        self.counts = {"placed": 0, "placed_with_group": 0}

    def place(self, group_id: str) -> Replica:
        """The replica for a new episode of `group_id` (counted there until `release`)."""
        least = min(self.replicas, key=lambda r: r.load)
        warm = [r for r in self.replicas if r.groups[group_id] and r.episodes <= least.episodes + self.affinity_slack]
        chosen = min(warm, key=lambda r: r.load) if warm else least
        chosen.episodes += 1
        chosen.groups[group_id] += 1
        self.counts["placed"] += 1
        self.counts["placed_with_group"] += bool(warm)
        return chosen

    def release(self, replica: Replica, group_id: str) -> None:
        replica.episodes -= 1
        replica.groups[group_id] -= 1
        if replica.groups[group_id] <= 0:
            del replica.groups[group_id]

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "replicas": [{"name": r.name, "episodes": r.episodes, "in_flight": r.in_flight,
                                             "served": r.served} for r in self.replicas]}
