"""The RL loop, on rank 0. It reads as the algorithm:

    rollout side serves the policy -> agent episodes (rewards) -> back to training -> filter
          -> mini-batch layout -> update_policy (on the training side: reference / old logprobs,
             KL-in-reward, advantages, PPO updates) -> log / validate / checkpoint

The batch reaches the training side once per step (one `TrainSide.update_policy` call); scalars,
per-row values and the ledger's per-token lineage come back from it. How the rollout side is
reached (a mode switch on the same ranks, or a publication to other ranks) and how a step collects
its trajectories are the placement's (`controller/placements.py`); what happens at the named
moments of a step outside the algorithm (faults, the console's progress, callbacks) is the run's
hooks (`controller/state.py`).
"""

from __future__ import annotations

import logging
import time

import torch

from hybridrl.algo import partial
from hybridrl.algo.groups import group_index_of
from hybridrl.algo.minibatches import lay_out, plan
from hybridrl.controller import critic as C
from hybridrl.controller import curriculum
from hybridrl.controller import metrics as M
from hybridrl.controller.collection import admitted
from hybridrl.controller.evaluation import evaluate_in_loop
from hybridrl.controller.state import RunState
from hybridrl.cost.clock import RunClock
from hybridrl.data.batch import Batch
from hybridrl.data.trajectory import from_batch, to_batch
from hybridrl.telemetry import spans
from hybridrl.telemetry.timers import StageTimer
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.train_side import TrainSide

log = logging.getLogger(__name__)


def train(cfg, wg) -> dict:
    tc = cfg.trainer
    run = RunState.open(cfg, wg)
    collection = cfg.placement.resolve().collection(cfg, wg, run)     # sync | partial | stream
    run.restore(collection)
    link = collection.link
    clock = RunClock.start(cfg, resumed=run.resumed_from is not None, step=run.step, world_size=wg.world_size)
    if run.step == 0:
        run.log(0, {**validate(cfg, wg, run, link, step=0), **evaluate_in_loop(cfg, wg, run, link, 0)})
    for step in run.steps():                   # to trainer.total_steps, or until the hooks stop the run
        clock.mark("step", step)                   # what the step's metrics do not time: hybridrl/cost
        timer, started = StageTimer(), time.perf_counter()
        rollout_version = run.version

        with timer("sync"):
            switch = link.to_rollout(run.version, run.trained_at)
        run.hooks.at(step, "switch")
        with timer("rollout"):
            trajectories, collected = collection.rollout(step)
        run.hooks.at(step, "rollout")
        with timer("sync"):
            switch.update(link.to_train())

        with timer("prep"):
            kept = admitted(cfg, trajectories, run.version)
            collected.update(curriculum.after_admission(cfg, run.stream, kept.kept))   # shares of trained groups
            # the trajectories stay here: the batch needs no records to rebuild them from
            batch = to_batch(kept.kept, pad_id=run.pad_id, records=False) if kept.kept else None
            if batch is not None:
                collected.update(partial.apply(cfg.algo.partial_policy, batch))   # multi-version rows
                layout = plan(len(batch), wg.mesh("train").dp_size, cfg.algo.ppo_mini_batches)
                sent = lay_out(update_inputs(batch), layout)

        updates_actor = batch is not None and C.actor_trains(cfg, step)     # gae: not in the critic's warm-up
        with timer("train"):
            update, critic = {}, {}
            if batch is not None:
                out = wg.call(TrainSide.update_policy, sent, mini_batch_rows=layout.rows_per_rank,
                              num_groups=int(sent["group_index"].max()) + 1, update_actor=updates_actor)
                update, critic = out.info["metrics"], out.info["critic"]
                record_rows(kept.kept, out, layout)
                if cfg.store.enabled and updates_actor:   # the ledger keeps the policy update's per-token old
                    # logprobs and advantages (a critic warm-up step takes none: only the critic trains)
                    attach_lineage(batch, out, layout)
        run.hooks.at(step, "train")
        if updates_actor:
            run.updated(step)

        metrics = M.step_metrics(trajectories, kept, batch, update, switch, timer.pop(),
                                 wall_s=time.perf_counter() - started, world_size=wg.world_size,
                                 version=run.version, rollout_version=rollout_version)
        metrics.update(collected)
        metrics["train/updated"] = float(updates_actor)   # a step without a learning signal goes on
        metrics.update(critic)
        metrics.update(M.engine_metrics(wg.call(RolloutSide.rollout_stats), run))
        metrics.update(run.hooks.efficiency.step(metrics, batch))     # MFU, T_comm, successes per hour...
        if run.rolled_back(step, metrics):         # incidents of the update (NaN, mismatch, KL, failed episodes)
            continue                               # rolled back: on from the checkpoint's step
        if step == tc.total_steps or (tc.validate_every and step % tc.validate_every == 0):
            metrics.update(validate(cfg, wg, run, link, step))
        metrics.update(evaluate_in_loop(cfg, wg, run, link, step))     # trainer.eval_suite, when due
        if run.rolled_back(step, metrics):         # ... and of the held-out scores (a drop from the best)
            continue
        checkpoint = tc.checkpoint_every and step % tc.checkpoint_every == 0
        metrics["time/T_store"] = run.ledger.record_step(
            step, trajectories=trajectories, kept=kept, batch=batch, switch=switch, rollout_version=rollout_version,
            version_after=run.version, metrics=metrics,
            checkpoint=str(run.checkpoints.path(step)) if checkpoint else None)
        metrics["time/logged_at"] = time.time()      # wall clock: throughput over steps, whatever overlaps
        run.log(step, metrics, samples=trajectories)
        run.hooks.at(step, "log")
        if checkpoint:
            with clock.span("checkpoint", step):
                run.save_checkpoint(step, link)
    clock.mark("finish", run.step)
    run.finish(wg)
    clock.mark("end", run.step)
    return run.summary()


def update_inputs(batch: Batch) -> Batch:
    """What `TrainSide.update_policy` needs of a batch: tokens, masks, behaviour logprobs, the
    outcome reward, each row's group as a dense index (metadata stays on the controller) and, for
    MoE policies, the rollout's routing record (the engine replays or compares it)."""
    names = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "reward")
    names += ("routed_experts",) if "routed_experts" in batch.tensors else ()    # MoE: the rollout's routing
    return Batch({**{n: batch[n] for n in names}, "group_index": group_index_of(batch["group_id"])})


def record_rows(trajectories: list, out: Batch, layout) -> None:
    """Per-trajectory values from the update (its advantage, its rollout/trainer mismatch) into each
    trajectory's metadata; `out` holds one row per position of the laid-out batch."""
    for position in layout.real_positions:
        t = trajectories[layout.order[position]]
        for key in ("advantage", "mismatch_max_abs"):
            t.metadata[key] = float(out[key][position])


def attach_lineage(batch: Batch, out: Batch, layout) -> None:
    """The update's per-token tensors (rows of the laid-out batch) set on `batch` in its own row order."""
    positions = torch.tensor(layout.real_positions, dtype=torch.long)
    rows = torch.empty(len(batch), dtype=torch.long)
    rows[torch.tensor([layout.order[p] for p in layout.real_positions], dtype=torch.long)] = positions
    for name in ("old_logprobs", "advantages", "ref_logprobs"):
        if name in out.tensors:
            batch.set(name, out[name][rows])


@spans.traced("validate")                     # on the run's timeline (telemetry/spans.py)
def validate(cfg, wg, run: RunState, link, step: int) -> dict:
    """Accuracy of the current policy on the held-out split (greedy by default). Leaves the rollout side
    serving the current version; the next step's switch is then a no-op."""
    tc = cfg.trainer
    started = time.perf_counter()
    switch = link.ensure_rollout(run.version, run.trained_at)
    if switch is not None:
        run.ledger.record_switch(step, switch, purpose="validation")
    rows = M.episode_rows(run.validation, 1, f"val{step}")
    trajectories = from_batch(wg.call(RolloutSide.rollout, rows, temperature=tc.validation_temperature))
    out = M.validation_metrics(trajectories)
    # the validation episodes' engine and agent counters, kept out of the next training step's
    out.update({f"val/{k}": v for k, v in M.engine_metrics(wg.call(RolloutSide.rollout_stats), run).items()})
    out["val/seconds"] = time.perf_counter() - started
    log.info("validation at step %d (policy v%d): accuracy %.3f on %d episodes", step, run.version,
             out["val/accuracy"], len(trajectories))
    return out
