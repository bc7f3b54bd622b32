"""Jobs for the RL runs against vLLM (`hybridrl train ... run.job=tests.backends.vllm.rl_jobs:NAME`): the
colocated hybrid tests' corruption controller, with the damage done inside vLLM's worker process."""

from __future__ import annotations

from hybridrl.controller.placements import build_colocated, build_disaggregated
from hybridrl.controller.worker_group import WorkerGroupError
from hybridrl.distributed.dispatch import OneToAll
from hybridrl.jobs import Job
from hybridrl.workers.base import Part, register
from hybridrl.workers.rollout_side import RolloutSide
from tests.backends.vllm.faults import damage_after_copy
from tests.workers.hybrid_jobs import CORRUPTED, PROMPTS, _train_once, _write, link_of


class VLLMCopyDamage(Part):
    """Damages a rollout rank's vLLM parameters after its copies (see `faults.damage_after_copy`)."""

    def __init__(self, rollout: RolloutSide):
        self.rollout = rollout

    @register(dispatch=OneToAll(mesh="rollout"))
    def set_fault(self, name: str, times: int = 1) -> None:
        if self.rollout.owns_engine:
            self.rollout.engine.call_worker(damage_after_copy, name, times)


def faulty_worker(cfg, ctx):
    worker = (build_disaggregated if cfg.placement.disaggregated else build_colocated)(cfg, ctx)
    rollout = worker.part(RolloutSide)
    return worker.extend(VLLMCopyDamage(rollout)) if rollout is not None else worker


def corrupted_publication(cfg, wg):
    """v0 as loaded; v1 with one damaged copy (copied again, verified); v2 damaged on every copy (the step stops)."""
    link = link_of(cfg, wg)
    link.to_rollout(0, 0)
    v0 = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)
    link.to_train()
    _train_once(wg, vocab=500)
    wg.call(VLLMCopyDamage.set_fault, name=CORRUPTED, times=1)
    retried = link.to_rollout(1, 1)
    v1 = wg.call(RolloutSide.sample, prompts=PROMPTS, max_new_tokens=8)
    link.to_train()
    _train_once(wg, vocab=500, seed=1)
    wg.call(VLLMCopyDamage.set_fault, name=CORRUPTED, times=-1)
    try:
        link.to_rollout(2, 2)
        failure = None
    except WorkerGroupError as err:
        failure = str(err)
    _write(cfg, {"v0": v0, "retried": retried, "v1": v1, "failure": failure})
    if failure:
        raise RuntimeError("expected failure recorded")   # the group is aborted after a worker error


CORRUPT = Job("corrupt-vllm", faulty_worker, corrupted_publication)
