"""How a step gets its trajectories (`trainer.rollout_mode`), on the controller.

    sync     draw `prompts_per_step` instances, run `group_size` episodes of each to the end
             (`HybridWorker.rollout`); the step waits for its slowest episode.
    partial  keep `groups_in_flight = ceil(prompts_per_step * oversample)` groups in flight: draw
             as many new instances as groups were returned by the last step, launch them, and end
             the rollout when `quorum` groups are complete over all engines (or at
             `rollout_deadline_s`); the episodes still running are interrupted at a token boundary
             and continue at the next step on the newly published policy
             (`HybridWorker.collect`, `agent/collector.py`). A step trains on complete groups only.

Both return the step's trajectories and the collection's metrics (`partial/*`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hybridrl.controller import metrics as M
from hybridrl.data.trajectory import Trajectory, from_batch
from hybridrl.workers.hybrid import HybridWorker


class SyncCollection:
    def __init__(self, cfg: Any, wg: Any, run: Any):
        self.cfg, self.wg, self.run = cfg, wg, run

    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        tc = self.cfg.trainer
        instances = self.run.stream.next(tc.prompts_per_step)
        return from_batch(self.wg.call(HybridWorker.rollout, M.episode_rows(instances, tc.group_size, step))), {}


class PartialCollection:
    def __init__(self, cfg: Any, wg: Any, run: Any):
        self.cfg, self.wg, self.run = cfg, wg, run
        self.in_flight: dict[str, dict] = {}      # group id -> its instance (launched, not yet returned)

    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        tc = self.cfg.trainer
        instances = self.run.stream.next(max(0, tc.groups_in_flight - len(self.in_flight)))
        rows = M.episode_rows(instances, tc.group_size, step)
        episodes = [{"instance": i, "attempt": a, "group_id": g}
                    for i, a, g in zip(rows["instance"], rows["attempt"], rows["group_id"])] if instances else []
        for e in episodes:
            self.in_flight[e["group_id"]] = e["instance"]
        outs = self.wg.call(HybridWorker.collect, episodes=episodes, quorum=tc.quorum_groups,
                            deadline_s=tc.rollout_deadline_s, poll_s=tc.collect_poll_s)
        trajectories = [t for out in outs for t in out["trajectories"]]
        if not trajectories:        # the deadline passed before any group was complete: wait for one
            outs = self.wg.call(HybridWorker.collect, episodes=[], quorum=1, deadline_s=0.0, poll_s=tc.collect_poll_s)
            trajectories = [t for out in outs for t in out["trajectories"]]
        for g in {t.group_id for t in trajectories}:
            self.in_flight.pop(g, None)
        stats = [out["stats"] for out in outs]
        stopped = Counter(s["stopped_by"] for s in stats)
        continued = [t for t in trajectories if t.metadata.get("interruptions")]
        return trajectories, {
            "partial/launched_groups": float(len(instances)),
            "partial/returned_groups": float(len({t.group_id for t in trajectories})),
            "partial/groups_in_flight": float(len(self.in_flight)),
            "partial/interrupted": float(sum(s["interrupted"] for s in stats)),
            "partial/live_episodes": float(sum(s["live"] for s in stats)),
            "partial/waiting_episodes": float(sum(s["waiting"] for s in stats)),
            "partial/continued_episodes": float(len(continued)),
            "partial/multi_version_episodes": float(sum(len(t.versions) > 1 for t in trajectories)),
            "partial/stopped_by_deadline": float(stopped.most_common(1)[0][0] == "deadline") if stopped else 0.0,
        }


def make_collection(cfg: Any, wg: Any, run: Any) -> SyncCollection | PartialCollection:
    return PartialCollection(cfg, wg, run) if cfg.trainer.rollout_mode == "partial" else SyncCollection(cfg, wg, run)
