"""A placement written outside the package, as a user would: the disaggregated placement's ranks and
link, but each step waits for its own rollout (the sync collection) instead of generating ahead."""

from __future__ import annotations

from hybridrl.controller.collection import RemoteLink, SyncCollection
from hybridrl.controller.placements import build_disaggregated
from hybridrl.distributed.placement import Placement

LOCKSTEP = Placement("lockstep", split_roles=True, build=build_disaggregated,
                     collection=lambda cfg, wg, run: SyncCollection(cfg, wg, run, RemoteLink(wg)),
                     summary="training and rollout ranks apart; every step generates with the newest policy")
