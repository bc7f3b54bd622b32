"""What the shipped placements' rows (`distributed/placement.py: PLACEMENTS`) build: which parts each
rank holds, which link joins the training and rollout sides, which collection strategy the controller runs.

    placement       ranks hold                              link                 collection
    colocated       TrainSide + RolloutSide (every rank)    ModeSwitch           sync | partial
    disaggregated   TrainSide (ranks 0..T-1)                SendingEnd           stream
                    RolloutSide + StreamProducer (T..W-1)   ReceivingEnd

A placement of your own is a `Placement(name, split_roles, build, collection)` in your module,
named by `placement.mode=package.module:ATTR`; `build` can reuse the functions below.
"""

from __future__ import annotations

from typing import Any

from hybridrl.distributed.mesh import Mesh, train_mesh
from hybridrl.workers.faults import Faults
from hybridrl.workers.modes import Arrivals, ModeMachine, Phases
from hybridrl.workers.rank import RankWorker


def phases_for(cfg: Any, ctx: Any, ranks: list[int], cls: type = Phases) -> Phases:
    """This rank's timed phases; a switch's phases wait at barriers for `ranks` (those that run them)."""
    from hybridrl.telemetry import spans
    from hybridrl.workers.switch import report_overrun

    if cfg.telemetry.timeline:
        spans.open_log(cfg.run.dir, ctx.rank)      # this rank's timeline (`hybridrl inspect RUN --timeline`)
    return cls(ctx.device, rank=ctx.rank, deadlines=cfg.hybrid.deadlines(),
               arrivals=Arrivals(ctx.control.store, ctx.rank, ranks, aborted=ctx.control.aborted),
               on_overrun=report_overrun(ctx), overrun_grace_s=max(2.0, ctx.cfg.error_grace_s))


def rollout_mesh(cfg: Any, ranks: list[int]) -> Mesh:
    """dp x tp over the rollout ranks (`rollout.tp` ranks per engine)."""
    return Mesh("rollout", ("dp", "tp"), (len(ranks) // cfg.rollout.tp, cfg.rollout.tp), first=ranks[0])


def build_colocated(cfg: Any, ctx: Any, *, switch: type | None = None) -> RankWorker:
    """Every rank: both sides, switching between them (`switch`: the link's class, ModeSwitch unless a
    test or an experiment brings a variant)."""
    from hybridrl.workers.publisher import publication_source
    from hybridrl.workers.rollout_side import RolloutSide
    from hybridrl.workers.switch import ModeSwitch
    from hybridrl.workers.train_side import TrainSide

    everyone = list(range(ctx.world_size))
    modes = phases_for(cfg, ctx, everyone, ModeMachine)
    train = TrainSide(cfg, ctx, modes)
    rollout = RolloutSide(cfg, ctx, modes, rollout_mesh(cfg, everyone),
                          follower_spec=publication_source(cfg, train.actor).hf_spec)
    link = (switch or ModeSwitch)(cfg, ctx, modes, train, rollout)
    meshes = {"world": Mesh.flat("world", ctx.world_size), "train": train.mesh, "rollout": rollout.mesh}
    return RankWorker(ctx, [train, rollout, link, Faults(ctx, train=train, rollout=rollout, meshes=meshes)],
                      meshes, modes)


def split_meshes(cfg: Any, ctx: Any) -> dict[str, Mesh]:
    roles = ctx.roles
    return {"world": Mesh.flat("world", roles.world_size),
            "train": train_mesh(roles.num_train, cfg.train.tp, cfg.train.pp),
            "rollout": rollout_mesh(cfg, roles.rollout_ranks)}


def build_disaggregated(cfg: Any, ctx: Any) -> RankWorker:
    """Training ranks hold a training side and send each policy; rollout ranks generate continuously."""
    from transformers import AutoTokenizer

    from hybridrl.workers.remote import ReceivingEnd, SendingEnd, StreamProducer
    from hybridrl.workers.rollout_side import RolloutSide
    from hybridrl.workers.train_side import TrainSide

    meshes = split_meshes(cfg, ctx)
    if ctx.role == "train":
        phases = phases_for(cfg, ctx, ctx.roles.train_ranks)
        train = TrainSide(cfg, ctx, phases)
        link = SendingEnd(cfg, ctx, phases, train, AutoTokenizer.from_pretrained(cfg.model.path))
        parts = [train, link, Faults(ctx, train=train, meshes=meshes)]
    else:
        phases = phases_for(cfg, ctx, ctx.roles.rollout_ranks)
        rollout = RolloutSide(cfg, ctx, phases, meshes["rollout"], threaded=True)
        producer = StreamProducer(ctx, rollout)
        link = ReceivingEnd(cfg, ctx, phases, rollout, producer)
        parts = [rollout, producer, link, Faults(ctx, rollout=rollout, meshes=meshes)]
    return RankWorker(ctx, parts, meshes, phases)


def colocated_collection(cfg: Any, wg: Any, run: Any):
    from hybridrl.controller.collection import ModeSwitchLink, PartialCollection, SyncCollection

    kind = PartialCollection if cfg.trainer.rollout_mode == "partial" else SyncCollection
    return kind(cfg, wg, run, ModeSwitchLink(wg))


def stream_collection(cfg: Any, wg: Any, run: Any):
    from hybridrl.controller.collection import RemoteLink, StreamCollection

    return StreamCollection(cfg, wg, run, RemoteLink(wg))


def make_worker(cfg: Any, ctx: Any) -> RankWorker:
    """The rl job's worker on this rank, as its placement builds it."""
    return cfg.placement.resolve().build(cfg, ctx)
