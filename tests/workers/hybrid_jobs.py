"""Controllers (and fault-injecting parts) for the colocated placement's tests; each writes result.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hybridrl.controller.placements import build_colocated
from hybridrl.controller.worker_group import WorkerGroupError
from hybridrl.data.batch import Batch
from hybridrl.jobs import Job
from hybridrl.distributed.dispatch import ONE_TO_ALL, OneToAll
from hybridrl.workers.base import Part, register
from hybridrl.workers.modes import IllegalTransition  # noqa: F401  (re-exported for tests)
from hybridrl.workers.rank import RankWorker
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.switch import ModeSwitch
from hybridrl.workers.train_side import TrainSide

PROMPTS = [[1, 276, 201, 19, 20, 21], [1, 312, 201, 318, 311, 22, 23, 24, 12, 25], [1, 280, 201]]


def damage_after_copy(core, name: str | None, times: int = 1) -> None:
    """Damage a native engine's own storage of tensor `name` right after the engine copied it (`times`
    copies; -1: every copy; None: stop). The sender and the verifier are untouched."""
    real = getattr(core, "_real_copy", None) or core.copy_into_storage
    core._real_copy = real
    left = [float("inf") if times < 0 else times]

    def faulty(items):
        real(items)
        if name is not None and left[0] > 0 and any(n == name for n, _ in items):
            core.views[name].view(-1)[0] += 1.0
            left[0] -= 1

    core.copy_into_storage = faulty


class CopyDamage(Part):
    """Damages a rollout rank's native engine storage after its copies (see `damage_after_copy`)."""

    def __init__(self, rollout: RolloutSide):
        self.rollout = rollout

    @register(dispatch=OneToAll(mesh="rollout"))
    def set_fault(self, name: str | None, times: int = 1) -> None:
        self.rollout.run_sync(lambda: damage_after_copy(self.rollout.engine.core, name, times))   # on its thread


def link_of(cfg, wg):
    """How this test's controller reaches the rollout side in the run's placement."""
    from hybridrl.controller.collection import ModeSwitchLink, RemoteLink

    return RemoteLink(wg) if cfg.placement.disaggregated else ModeSwitchLink(wg)


def faulty_worker(cfg, ctx) -> RankWorker:
    worker = build_colocated(cfg, ctx)
    return worker.extend(CopyDamage(worker.part(RolloutSide)))


def _write(cfg, result):
    out = Path(cfg.run.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result))


def _train_once(wg, vocab: int, seed: int = 0) -> dict:
    """One update on a synthetic batch, so that the next version's weights differ."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 16), generator=g)
    mask = torch.zeros(4, 16)
    mask[:, 8:] = 1
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones(4, 16, dtype=torch.long), "loss_mask": mask})
    old = wg.call(TrainSide.compute_logprobs, batch)["old_logprobs"]
    batch.set("old_logprobs", old)
    batch.set("behavior_logprobs", old.clone())
    batch.set("advantages", torch.where(torch.rand(4, 1, generator=g) > 0.5, 1.0, -1.0).expand(4, 16) * mask)
    return wg.call(TrainSide.train_step, batch)[0]


def publish_then_sample(cfg, wg) -> dict:
    wg.call(ModeSwitch.enter_rollout, version=0, step=0)
    before = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)
    wg.call(ModeSwitch.enter_train)
    update = _train_once(wg, vocab=500)
    switch = wg.call(ModeSwitch.enter_rollout, version=1, step=1)
    after = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)
    wg.call(TrainSide.export_hf, out_dir=str(Path(cfg.run.dir) / "hf"))
    result = {"prompts": PROMPTS, "before": before, "after": after, "switch": switch, "update": update}
    _write(cfg, result)
    return result


CORRUPTED = "model.layers.0.mlp.down_proj.weight"


def corrupted_publication(cfg, wg, result: dict | None = None, first: int = 0):
    """From version `first` (sampled at it already when `result` holds what was written so far): a damaged
    copy of version first + 1 is copied again; every copy of first + 2 damaged stops the step."""
    link = link_of(cfg, wg)
    if result is None:
        link.to_rollout(first, first)
        result = {"v0": wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)}
    else:
        result["v0"] = result["after"]
    link.to_train()
    _train_once(wg, vocab=500)
    wg.call(CopyDamage.set_fault, name=CORRUPTED, times=1)     # one bad copy: copied again, verified
    retried = link.to_rollout(first + 1, first + 1)
    v1 = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)
    link.to_train()
    _train_once(wg, vocab=500, seed=1)
    wg.call(CopyDamage.set_fault, name=CORRUPTED, times=-1)    # every copy bad: the step stops
    try:
        link.to_rollout(first + 2, first + 2)
        failure = None
    except WorkerGroupError as err:
        failure = str(err)
    _write(cfg, {**result, "retried": retried, "v1": v1, "failure": failure})
    if failure:
        raise RuntimeError("expected failure recorded")   # the group is aborted after a worker error


def publish_then_corrupt(cfg, wg):
    """PUBLISH's run, then the damaged copies from its version 1 on (one job for both tests: one start)."""
    corrupted_publication(cfg, wg, publish_then_sample(cfg, wg), first=1)


def memory(cfg, wg):
    _train_once(wg, vocab=500)
    train = wg.call(RankWorker.memory_report)[0]
    wg.call(ModeSwitch.enter_rollout, version=1, step=1)
    wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=4)
    rollout = wg.call(RankWorker.memory_report)[0]
    wg.call(ModeSwitch.enter_train)
    back = wg.call(RankWorker.memory_report)[0]
    again = _train_once(wg, vocab=500, seed=1)
    _write(cfg, {"train": train, "rollout": rollout, "back": back, "again": again})


PUBLISH = Job("publish", build_colocated, publish_then_sample)
PUBLISH_THEN_CORRUPT = Job("publish_then_corrupt", faulty_worker, publish_then_corrupt)
MEMORY = Job("memory", build_colocated, memory)




class StuckSwitch(ModeSwitch):
    """Faults for the bounded-switch tests: a rank that stops arriving, an engine that never drains."""

    @register(dispatch=ONE_TO_ALL)
    def stall_next_switch(self, rank: int, seconds: float) -> None:
        self._stall = (rank, seconds)

    @register(dispatch=ONE_TO_ALL)
    def engine_never_drains(self) -> None:
        import asyncio

        async def sleep_forever(tags=()):
            await asyncio.Event().wait()       # the aborted requests never end

        self.engine.sleep = sleep_forever

    @register(dispatch=OneToAll("rank0"))
    def enter_rollout(self, *, version: int, step: int) -> dict:
        import time

        stall = getattr(self, "_stall", None)
        if stall is not None and stall[0] == self.ctx.rank:
            time.sleep(stall[1])              # this rank stops arriving
        return super().enter_rollout(version=version, step=step)


def stuck_worker(cfg, ctx) -> RankWorker:
    return build_colocated(cfg, ctx, switch=StuckSwitch)


def _timed_failure(call) -> dict:
    import time

    started = time.monotonic()
    try:
        call()
        return {"failure": None}
    except WorkerGroupError as err:
        return {"failure": str(err), "seconds": time.monotonic() - started}


def rank_stops_arriving(cfg, wg):
    wg.call(StuckSwitch.stall_next_switch, rank=1, seconds=600)
    result = _timed_failure(lambda: wg.call(ModeSwitch.enter_rollout, version=1, step=1))
    _write(cfg, result)
    raise RuntimeError("expected failure recorded")


def engine_never_drains(cfg, wg):
    wg.call(ModeSwitch.enter_rollout, version=1, step=1)
    wg.call(StuckSwitch.engine_never_drains)
    result = _timed_failure(lambda: wg.call(ModeSwitch.enter_train))
    _write(cfg, result)
    raise RuntimeError("expected failure recorded")


STALLED_RANK = Job("stalled_rank", stuck_worker, rank_stops_arriving)
NEVER_DRAINS = Job("never_drains", stuck_worker, engine_never_drains)


class GroupedSwitch(StuckSwitch):
    """Records, on every rank, what each switch decided: (version asked, published, engine version)."""

    @register(dispatch=OneToAll("rank0"))
    def enter_rollout(self, *, version: int, step: int) -> dict:
        out = super().enter_rollout(version=version, step=step)
        self._switches = [*getattr(self, "_switches", []), [version, out["published"], self.engine.policy_version]]
        return out

    @register(dispatch=ONE_TO_ALL)
    def switch_log(self) -> list:
        return getattr(self, "_switches", [])

    def _publish(self, version, step, verdict):
        refused = super()._publish(version, step, verdict)
        self._refusals = [*getattr(self, "_refusals", []), refused]
        return refused

    @register(dispatch=ONE_TO_ALL)
    def refusal_log(self) -> list:
        """What each publication of this rank returned: None (published) or why it was refused."""
        return getattr(self, "_refusals", [])

    @register(dispatch=ONE_TO_ALL)
    def refuse_next_switch(self, rank: int, reason: str) -> None:
        """Rank `rank`'s own structure check refuses the next switch's publication (the others accept)."""
        if self.ctx.rank == rank:
            real = self.publisher.refusal

            def once(*args):
                self.publisher.refusal = real
                return reason

            self.publisher.refusal = once


def grouped_rollout(cfg, wg):
    """rollout.tp=2 with the native engine: one engine on rank 0 serves the group of 2 ranks (rank 1
    holds a FollowerEngine). Then the trainer's own order of calls around a validation followed by a
    checkpoint and around a step whose batch is empty, every rank recording what it decided; at the
    end rank 1 stops arriving at a switch (run with hybrid.offload_deadline_s=3)."""
    from hybridrl.controller.metrics import episode_rows
    from hybridrl.data.trajectory import from_batch
    from hybridrl.envs.tasks import get_task

    task = get_task(cfg.task.name, cfg.task)
    first = wg.call(ModeSwitch.enter_rollout, version=0, step=0)
    per_rank = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=6)
    wg.call(ModeSwitch.enter_train)
    _train_once(wg, vocab=500)
    switch = wg.call(ModeSwitch.enter_rollout, version=1, step=1)            # step 1
    trajectories = from_batch(wg.call(RolloutSide.rollout, episode_rows(task.train_split(2), 2, 1)))
    after = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=6)
    wg.call(ModeSwitch.enter_train)
    # validation (trainer.validate): from TRAIN into ROLLOUT at the current version, left there
    wg.call(ModeSwitch.enter_rollout, version=1, step=1)
    wg.call(RolloutSide.rollout, episode_rows(task.validation_split(1), 1, "val1"), temperature=0.0)
    # checkpoint (RunState.save_checkpoint): back to TRAIN, then save
    wg.call(ModeSwitch.enter_train)
    wg.call(TrainSide.save_checkpoint, path=str(Path(cfg.run.dir) / "ckpt"), extra={"step": 1})
    # step 2: its batch is empty (every group filtered out): no train step, the version stays
    wg.call(ModeSwitch.enter_rollout, version=1, step=2)
    wg.call(ModeSwitch.enter_train)
    # step 3: still nothing new to publish; its update makes version 2, published at step 4
    wg.call(ModeSwitch.enter_rollout, version=1, step=3)
    wg.call(ModeSwitch.enter_train)
    _train_once(wg, vocab=500, seed=1)
    wg.call(ModeSwitch.enter_rollout, version=2, step=4)
    v2 = wg.call(RolloutSide.sample, prompts=PROMPTS[:1], max_new_tokens=4)
    wg.call(ModeSwitch.enter_train)
    # step 5: only rank 1's own check refuses version 3; every rank refuses it, and both keep serving v2
    _train_once(wg, vocab=500, seed=2)
    wg.call(GroupedSwitch.refuse_next_switch, rank=1, reason="a test's refusal on rank 1")
    refused = wg.call(ModeSwitch.enter_rollout, version=3, step=5)
    switches = wg.call(GroupedSwitch.switch_log)
    refusals = wg.call(GroupedSwitch.refusal_log)
    wg.call(ModeSwitch.enter_train)
    wg.call(StuckSwitch.stall_next_switch, rank=1, seconds=600)
    stalled = _timed_failure(lambda: wg.call(ModeSwitch.enter_rollout, version=3, step=6))
    _write(cfg, {"first": first, "per_rank": per_rank, "switch": switch, "after": after, "v2": v2,
                 "versions": sorted({v for t in trajectories for v in t.versions}),
                 "episodes": len(trajectories), "switches": switches, "stalled": stalled,
                 "refused": refused, "refusals": refusals})
    raise RuntimeError("expected failure recorded")   # the group is aborted after a worker error


GROUPED = Job("grouped", lambda cfg, ctx: build_colocated(cfg, ctx, switch=GroupedSwitch), grouped_rollout)


def _ppo_batch(vocab: int, rows: int = 16, length: int = 20, seed: int = 0) -> Batch:
    """A synthetic rollout batch laid out for update_policy: groups of 3 (so that groups straddle
    mini-batches and data-parallel ranks), rewards 0/1, responses of unequal length, behaviour
    logprobs a little off the policy's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    attention = (torch.arange(length) < lengths.unsqueeze(1)).long()
    loss_mask = attention.float()
    loss_mask[:, :6] = 0                                              # the prompt
    return Batch({"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask,
                  "behavior_logprobs": torch.full((rows, length), -6.0) * loss_mask,
                  "reward": (torch.rand(rows, generator=g) > 0.5).float(),
                  "group_index": torch.arange(rows) // 3})


def _probe_logprobs(wg, vocab: int) -> list:
    """The policy's logprobs on a fixed batch: equal weights give equal logprobs."""
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(3, vocab, (4, 12), generator=g)
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones(4, 12, dtype=torch.long)})
    return wg.call(TrainSide.compute_logprobs, batch)["old_logprobs"].tolist()


def ppo_updates(cfg, wg):
    """update_policy as the trainer calls it: PPO (2 epochs x 4 mini-batches) on a batch laid out for
    this run's data-parallel size, then the policy's logprobs on a probe; then (with `one_update`) a
    step of one update per batch. Forward passes are counted by the engine."""
    from hybridrl.algo.minibatches import lay_out, plan

    batch = _ppo_batch(vocab=500)
    layout = plan(len(batch), wg.mesh("train").dp_size, 4)
    ppo = wg.call(TrainSide.update_policy, lay_out(batch, layout), mini_batch_rows=layout.rows_per_rank,
                  num_groups=6, ppo_epochs=2)
    from hybridrl.controller.trainer import attach_lineage

    attach_lineage(batch, ppo, layout)
    result = {"ppo": ppo.info, "rows": ppo["advantage"].tolist(),
              "order": layout.order, "probe": _probe_logprobs(wg, vocab=500),
              "lineage": {k: batch[k].tolist() for k in ("advantages", "old_logprobs", "loss_mask")}}
    single = plan(len(batch), wg.mesh("train").dp_size, 1)
    one = wg.call(TrainSide.update_policy, lay_out(_ppo_batch(vocab=500, seed=1), single),
                  mini_batch_rows=single.rows_per_rank, num_groups=6, ppo_epochs=1)
    result["one"] = one.info
    _write(cfg, result)


PPO = Job("ppo", build_colocated, ppo_updates)
