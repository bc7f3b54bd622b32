"""Jobs for the disaggregated-placement tests: the rollout rank's engine storage damaged right after
its copy (the sender and the verifier untouched); each job writes result.json."""

from __future__ import annotations

from hybridrl.controller.worker_group import WorkerGroupError
from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.jobs import Job
from hybridrl.workers.base import register
from hybridrl.workers.disaggregated import RolloutWorker, TrainerWorker
from hybridrl.workers.hybrid import HybridWorker
from tests.workers.hybrid_jobs import CORRUPTED, PROMPTS, _train_once, _write, damage_after_copy


class FaultyTrainer(TrainerWorker):
    @register(dispatch=ONE_TO_ALL)
    def set_fault(self, name: str | None, times: int = 1) -> None:
        return None                       # the damage happens where the engine is


class FaultyRollout(RolloutWorker):
    @register(dispatch=ONE_TO_ALL)
    def set_fault(self, name: str | None, times: int = 1) -> None:
        self.threads.call(damage_after_copy, self.engine.core, name, times)     # on the engine's thread


def make_faulty(cfg, ctx):
    return FaultyTrainer(cfg, ctx) if ctx.role == "train" else FaultyRollout(cfg, ctx)


def corrupted_publication(cfg, wg):
    """As the colocated test: one damaged copy is copied again and verified; damage on every copy stops
    the publication, naming the tensor, and the rollout engine stays on the version it had."""
    v0 = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=8)
    _train_once(wg, vocab=500)
    wg.call(FaultyTrainer.set_fault, name=CORRUPTED, times=1)
    retried = wg.call(HybridWorker.enter_rollout, version=1, step=1)
    v1 = wg.call(HybridWorker.sample, prompts=PROMPTS, max_new_tokens=8)
    _train_once(wg, vocab=500, seed=1)
    wg.call(FaultyTrainer.set_fault, name=CORRUPTED, times=-1)
    try:
        wg.call(HybridWorker.enter_rollout, version=2, step=2)
        failure = None
    except WorkerGroupError as err:
        failure = str(err)
    _write(cfg, {"v0": v0, "retried": retried, "v1": v1, "failure": failure})
    if failure:
        raise RuntimeError("expected failure recorded")   # the group is aborted after a worker error


CORRUPT = Job("corrupt", make_faulty, corrupted_publication)
