"""Jobs for the disaggregated-placement tests: the colocated tests' controllers, run by the two roles'
workers; here the rollout rank's engine storage is damaged right after its copy (the sender and the
verifier untouched)."""

from __future__ import annotations

from hybridrl.controller.placements import build_disaggregated
from hybridrl.jobs import Job
from hybridrl.workers.rollout_side import RolloutSide
from tests.workers.hybrid_jobs import CopyDamage, corrupted_publication


def make_faulty(cfg, ctx):
    worker = build_disaggregated(cfg, ctx)
    rollout = worker.part(RolloutSide)
    return worker.extend(CopyDamage(rollout)) if rollout is not None else worker


# the colocated test's controller, with this placement's link: one damaged copy is copied again and
# verified, damage on every copy stops the publication naming the tensor
CORRUPT = Job("corrupt", make_faulty, corrupted_publication)
