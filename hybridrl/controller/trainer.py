"""The RL loop, on rank 0. It reads as the algorithm:

    tasks -> rollout mode -> agent episodes (rewards) -> train mode -> filter -> mini-batch layout
          -> update_policy (worker-side: ref / old logprobs, KL-in-reward, advantages, PPO updates)
          -> (publish happens at the next switch) -> log / validate / checkpoint

The batch reaches the workers once per step (one `update_policy` call); scalars and per-row
values come back.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from hybridrl.algo import partial
from hybridrl.algo.filters import filter_trajectories
from hybridrl.algo.groups import group_index_of
from hybridrl.algo.minibatches import lay_out, plan
from hybridrl.controller import critic as C
from hybridrl.controller import metrics as M
from hybridrl.controller.collection import make_collection
from hybridrl.controller.state import RunState
from hybridrl.cost.clock import RunClock
from hybridrl.data.batch import Batch
from hybridrl.data.trajectory import from_batch, to_batch
from hybridrl.jobs import Job
from hybridrl.telemetry.timers import StageTimer
from hybridrl.workers.disaggregated import make_worker
from hybridrl.workers.hybrid import HybridWorker

log = logging.getLogger(__name__)


def train(cfg, wg) -> dict:
    tc, algo = cfg.trainer, cfg.algo
    run = RunState.start(cfg, wg)
    collection = make_collection(cfg, wg, run)     # trainer.rollout_mode: sync | partial
    clock = RunClock.start(cfg, resumed=run.resumed_from is not None, step=run.step, world_size=wg.world_size)
    if run.step == 0:
        run.log(0, validate(cfg, wg, run, step=0))
    bar = tqdm(range(run.step + 1, tc.total_steps + 1), initial=run.step, total=tc.total_steps,
               desc="rl", dynamic_ncols=True, disable=None)
    for step in bar:
        clock.mark("step", step)                   # what the step's metrics do not time: hybridrl/cost
        timer, started = StageTimer(), time.perf_counter()
        rollout_version = run.version

        with timer("sync"):
            switch = wg.call(HybridWorker.enter_rollout, version=run.version, step=step)
        run.faults.at(step, "switch")
        run.arm_faults(wg, step, "rollout")
        with timer("rollout"):
            trajectories, collected = collection.rollout(step)
        run.faults.at(step, "rollout")
        with timer("sync"):
            switch.update(wg.call(HybridWorker.enter_train))

        with timer("prep"):
            kept = filter_trajectories(trajectories, drop_truncated=algo.drop_truncated,
                                       drop_all_equal_groups=algo.drop_all_equal_groups,
                                       current_version=run.version,
                                       max_policy_lag=algo.max_policy_lag if algo.max_policy_lag >= 0 else None)
            batch = to_batch(kept.kept, pad_id=run.pad_id) if kept.kept else None
            if batch is not None:
                collected.update(partial.apply(algo.partial_policy, batch))   # multi-version rows
                layout = plan(len(batch), wg.mesh("train").dp_size, algo.ppo_mini_batches)
                sent = lay_out(update_inputs(batch), layout)

        updates_actor = batch is not None and C.actor_trains(cfg, step)     # gae: not in the critic's warm-up
        with timer("train"):
            update, critic = {}, {}
            if batch is not None:
                outs = wg.call(HybridWorker.update_policy, sent, mini_batch_rows=layout.rows_per_rank,
                               num_groups=int(sent["group_index"].max()) + 1, update_actor=updates_actor)
                update, critic = outs[0]["metrics"], outs[0].get("critic", {})
                record_rows(kept.kept, outs, layout)
                if cfg.store.enabled and updates_actor:   # the ledger keeps the policy update's per-token old
                    # logprobs and advantages (a critic warm-up step takes none: only the critic trains)
                    attach_lineage(batch, wg.call(HybridWorker.update_lineage), wg.mesh("train"), layout)
        run.faults.at(step, "train")
        if updates_actor:
            run.version += 1

        metrics = M.step_metrics(trajectories, kept, batch, update, switch, timer.pop(),
                                 wall_s=time.perf_counter() - started, world_size=wg.world_size,
                                 version=run.version, rollout_version=rollout_version)
        metrics.update(collected)
        metrics["train/updated"] = float(updates_actor)   # a step without a learning signal goes on
        metrics.update(critic)
        if batch is None:
            log.info("step %d: no update (none of %d episodes admitted: %s)", step, len(trajectories),
                     ", ".join(f"{k} {v}" for k, v in kept.counts.items() if v) or "no reason counted")
        metrics.update(M.engine_metrics(wg.call(HybridWorker.rollout_stats), run))
        if step == tc.total_steps or (tc.validate_every and step % tc.validate_every == 0):
            metrics.update(validate(cfg, wg, run, step))
        metrics["time/T_store"] = run.ledger.record_step(
            step, trajectories=trajectories, kept=kept, batch=batch, switch=switch, rollout_version=rollout_version,
            version_after=run.version, metrics=metrics,
            checkpoint=str(run.checkpoints.path(step)) if tc.checkpoint_every and step % tc.checkpoint_every == 0 else None)
        metrics["time/logged_at"] = time.time()      # wall clock: throughput over steps, whatever overlaps
        run.log(step, metrics, samples=trajectories)
        run.faults.at(step, "log")
        bar.set_postfix_str(M.postfix(metrics))
        if tc.checkpoint_every and step % tc.checkpoint_every == 0:
            with clock.span("checkpoint", step):
                run.save_checkpoint(wg, step)
    clock.mark("finish", run.step)
    run.finish(wg)
    clock.mark("end", run.step)
    return run.summary()


def update_inputs(batch: Batch) -> Batch:
    """What `HybridWorker.update_policy` needs of a batch: tokens, masks, behaviour logprobs, the
    outcome reward and each row's group as a dense index (metadata stays on the controller)."""
    names = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "reward")
    return Batch({**{n: batch[n] for n in names}, "group_index": group_index_of(batch["group_id"])})


def record_rows(trajectories: list, outs: list[dict], layout) -> None:
    """Per-trajectory values from the update (its advantage, its rollout/trainer mismatch) into each
    trajectory's metadata, in the order the layout sent them."""
    rows: dict[str, list] = {}
    for out in outs:                      # the output ranks' shares, in data-parallel order
        for key, values in out["rows"].items():
            rows.setdefault(key, []).extend(values)
    for position in layout.real_positions:
        t = trajectories[layout.order[position]]
        for key, values in rows.items():
            t.metadata[key] = values[position]


def attach_lineage(batch: Batch, per_rank: list, mesh, layout) -> None:
    """The update's per-token tensors (each output rank's share of the laid-out batch, in data-parallel
    order) set on `batch` in its own row order."""
    owners = sorted(mesh.output_ranks(), key=mesh.dp_rank)
    laid = Batch.concat([per_rank[r] for r in owners])
    positions = torch.tensor(layout.real_positions, dtype=torch.long)
    rows = torch.empty(len(batch), dtype=torch.long)
    rows[torch.tensor([layout.order[p] for p in layout.real_positions], dtype=torch.long)] = positions
    for name, values in laid.tensors.items():
        batch.set(name, values[rows])


def validate(cfg, wg, run: RunState, step: int) -> dict:
    """Accuracy of the current policy on the held-out split (greedy by default). Leaves the workers
    in rollout mode serving the current version; the next step's switch is then a no-op."""
    tc = cfg.trainer
    started = time.perf_counter()
    if wg.call(HybridWorker.mode) != "rollout":
        run.ledger.record_switch(step, wg.call(HybridWorker.enter_rollout, version=run.version, step=step))
    rows = M.episode_rows(run.validation, 1, f"val{step}")
    trajectories = from_batch(wg.call(HybridWorker.rollout, rows, temperature=tc.validation_temperature))
    out = M.validation_metrics(trajectories)
    # the validation episodes' engine and agent counters, kept out of the next training step's
    out.update({f"val/{k}": v for k, v in M.engine_metrics(wg.call(HybridWorker.rollout_stats), run).items()})
    out["val/seconds"] = time.perf_counter() - started
    log.info("validation at step %d (policy v%d): accuracy %.3f on %d episodes", step, run.version,
             out["val/accuracy"], len(trajectories))
    return out


JOB = Job("rl", make_worker, train)     # the hybrid worker, or by role when disaggregated
