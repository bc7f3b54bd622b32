"""Jobs for the disaggregated-placement tests: the colocated tests' controllers, run by the two roles'
workers; here the rollout rank's engine storage is damaged right after its copy (the sender and the
verifier untouched)."""

from __future__ import annotations

from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.jobs import Job
from hybridrl.workers.base import register
from hybridrl.workers.disaggregated import RolloutWorker, TrainerWorker
from tests.workers.hybrid_jobs import corrupted_publication, damage_after_copy


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


# the colocated test's controller: one damaged copy is copied again and verified, damage on every copy
# stops the publication naming the tensor (enter_train is a no-op for both roles here)
CORRUPT = Job("corrupt", make_faulty, corrupted_publication)
