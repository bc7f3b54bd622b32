"""The RL loop, on rank 0. It reads as the algorithm:

    tasks -> rollout mode -> agent episodes (rewards) -> train mode -> filter -> old / ref logprobs
          -> advantages -> update -> (publish happens at the next switch) -> log / validate / checkpoint
"""

from __future__ import annotations

import logging
import time

from tqdm import tqdm

from hybridrl.algo import partial
from hybridrl.algo.filters import filter_trajectories
from hybridrl.algo.groups import group_index_of
from hybridrl.algo.objective import compute_advantages, kl_token_rewards
from hybridrl.controller import metrics as M
from hybridrl.controller.collection import make_collection
from hybridrl.controller.state import RunState
from hybridrl.data.trajectory import from_batch, to_batch
from hybridrl.jobs import Job
from hybridrl.telemetry.timers import StageTimer
from hybridrl.workers.hybrid import HybridWorker

log = logging.getLogger(__name__)


def train(cfg, wg) -> dict:
    tc, algo = cfg.trainer, cfg.algo
    run = RunState.start(cfg, wg)
    collection = make_collection(cfg, wg, run)     # trainer.rollout_mode: sync | partial
    if run.step == 0:
        run.log(0, validate(cfg, wg, run, step=0))
    bar = tqdm(range(run.step + 1, tc.total_steps + 1), initial=run.step, total=tc.total_steps,
               desc="rl", dynamic_ncols=True, disable=None)
    for step in bar:
        timer, started = StageTimer(), time.perf_counter()
        rollout_version = run.version

        with timer("sync"):
            switch = wg.call(HybridWorker.enter_rollout, version=run.version, step=step)
        with timer("rollout"):
            trajectories, collected = collection.rollout(step)
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
            if batch is not None:
                batch.set("old_logprobs", wg.call(HybridWorker.compute_logprobs, batch)["old_logprobs"])
                token_rewards = None
                if algo.uses_reference:
                    batch.set("ref_logprobs", wg.call(HybridWorker.compute_ref_logprobs, batch)["ref_logprobs"])
                    if algo.kl_in == "reward":
                        token_rewards = kl_token_rewards(algo, batch["old_logprobs"], batch["ref_logprobs"],
                                                         batch["loss_mask"])
                batch.set("advantages", compute_advantages(algo, batch["reward"], group_index_of(batch["group_id"]),
                                                           batch["loss_mask"], token_rewards=token_rewards))

        with timer("train"):
            update = wg.call(HybridWorker.train_step, batch)[0] if batch is not None else {}
        if batch is not None:
            run.version += 1

        metrics = M.step_metrics(trajectories, kept, batch, update, switch, timer.pop(),
                                 wall_s=time.perf_counter() - started, world_size=wg.world_size,
                                 version=run.version, rollout_version=rollout_version)
        metrics.update(collected)
        metrics["train/updated"] = float(batch is not None)   # a step without a learning signal goes on
        if batch is None:
            log.info("step %d: no update (none of %d episodes admitted: %s)", step, len(trajectories),
                     ", ".join(f"{k} {v}" for k, v in kept.counts.items() if v) or "no reason counted")
        metrics.update(M.engine_metrics(wg.call(HybridWorker.rollout_stats), run))
        if step == tc.total_steps or (tc.validate_every and step % tc.validate_every == 0):
            metrics.update(validate(cfg, wg, run, step))
        run.log(step, metrics, samples=trajectories)
        bar.set_postfix_str(M.postfix(metrics))
        if tc.checkpoint_every and step % tc.checkpoint_every == 0:
            run.save_checkpoint(wg, step)
    run.finish(wg)
    return run.summary()


def validate(cfg, wg, run: RunState, step: int) -> dict:
    """Accuracy of the current policy on the held-out split (greedy by default). Leaves the workers
    in rollout mode serving the current version; the next step's switch is then a no-op."""
    tc = cfg.trainer
    started = time.perf_counter()
    if wg.call(HybridWorker.mode) != "rollout":
        wg.call(HybridWorker.enter_rollout, version=run.version, step=step)
    rows = M.episode_rows(run.validation, 1, f"val{step}")
    trajectories = from_batch(wg.call(HybridWorker.rollout, rows, temperature=tc.validation_temperature))
    out = M.validation_metrics(trajectories)
    # the validation episodes' engine and agent counters, kept out of the next training step's
    out.update({f"val/{k}": v for k, v in M.engine_metrics(wg.call(HybridWorker.rollout_stats), run).items()})
    out["val/seconds"] = time.perf_counter() - started
    log.info("validation at step %d (policy v%d): accuracy %.3f on %d episodes", step, run.version,
             out["val/accuracy"], len(trajectories))
    return out


JOB = Job("rl", HybridWorker, train)
