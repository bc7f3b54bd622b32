"""Controllers for the partial-rollout tests with real ranks; each writes result.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridrl.algo import partial
from hybridrl.controller import metrics as M
from hybridrl.data.trajectory import to_batch
from hybridrl.envs.tasks import get_task
from hybridrl.controller.placements import build_colocated
from hybridrl.jobs import Job
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.switch import ModeSwitch
from hybridrl.workers.train_side import TrainSide
from tests.workers.hybrid_jobs import _train_once


def _episodes(instances, group_size: int, step: int) -> list[dict]:
    rows = M.episode_rows(instances, group_size, step)
    return [{"instance": i, "attempt": a, "group_id": g}
            for i, a, g in zip(rows["instance"], rows["attempt"], rows["group_id"])]


def continued_across_an_update(cfg, wg):
    """v0: run episodes for one slice of engine steps and interrupt them mid-turn holding v0 tokens;
    train once; publish v1; let them finish. Then score the continued trajectories with the
    reference (= the v0 weights) and the actor (= v1).

    The v0 window is fixed by the events, never by the clock: a quorum of 0 complete groups stops the
    collection after its first slice (`POLL_STEPS` steps of the native engine's loop driver), when every
    episode is inside its first turn (turns far longer than a slice), so each one is aborted at a token
    boundary and continues on v1 whatever the machine's speed or load."""
    task = get_task(cfg.task.name, cfg.task)
    tc = cfg.trainer
    wg.call(ModeSwitch.enter_rollout, version=0, step=0)
    new = _episodes(task.train_split()[:2], tc.group_size, 0)
    outs = wg.call(RolloutSide.collect, episodes=new, quorum=0, deadline_s=0.0, poll_s=0.005)
    first = [t for out in outs for t in out["trajectories"]]
    held = sum(out["stats"]["live"] for out in outs)
    window = [{k: out["stats"][k] for k in ("stopped_by", "live", "interrupted", "live_tokens")} for out in outs]
    wg.call(ModeSwitch.enter_train)
    update = _train_once(wg, vocab=500)
    wg.call(ModeSwitch.enter_rollout, version=1, step=1)
    outs = wg.call(RolloutSide.collect, episodes=[], quorum=10 ** 6, deadline_s=0.0, poll_s=0.01)
    after = [t for out in outs for t in out["trajectories"]]
    wg.call(ModeSwitch.enter_train)
    mixed = [t for t in after if t.versions == {0, 1}]
    result = {"held": held, "first_versions": sorted({v for t in first for v in t.versions}),
              "window": window, "after": len(after), "mixed": len(mixed), "update": {k: float(v) for k, v in update.items()},
              "stopped_by": [out["stats"]["stopped_by"] for out in outs],
              "live_after": [out["stats"]["live"] for out in outs]}
    if mixed:
        batch = to_batch(mixed, pad_id=0)
        ref = wg.call(TrainSide.compute_ref_logprobs, batch)["ref_logprobs"]      # v0 weights
        actor = wg.call(TrainSide.compute_logprobs, batch)["old_logprobs"]        # v1 weights
        mask, versions, behaviour = batch["loss_mask"].bool(), batch["policy_version"], batch["behavior_logprobs"]
        v0, v1 = mask & (versions == 0), mask & (versions == 1)
        result.update({
            "v0_tokens": int(v0.sum()), "v1_tokens": int(v1.sum()),
            "v0_vs_ref": float((behaviour - ref)[v0].abs().max()),
            "v1_vs_actor": float((behaviour - actor)[v1].abs().max()),
            "v1_vs_ref": float((behaviour - ref)[v1].abs().max()),
            "interruptions": [t.metadata.get("interruptions", 0) for t in mixed],
        })
        newest = to_batch(mixed, pad_id=0)
        partial.apply("newest_segment", newest)
        result["newest_mask_is_v1"] = bool(torch.equal(newest["loss_mask"].bool(), v1))
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run.dir) / "result.json").write_text(json.dumps(result))


CONTINUED = Job("continued", build_colocated, continued_across_an_update)
