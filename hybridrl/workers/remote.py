"""The disaggregated placement's link between the sides, which live on different ranks: training
rank 0 sends each new policy to the rollout ranks over a publish group (training rank 0 + every
rollout rank), while the rollout ranks keep generating; and the rollout ranks' continuous collection.

    SendingEnd     (training ranks) every training rank writes the flat buckets (the TP gathers and
                   PP broadcasts are collective); training rank 0 holds them whole and broadcasts
                   them (`publication/transport_remote.py`); then the parity probe, rescored here
    ReceivingEnd   (rollout ranks) first lets every group that runs on the version served now end
                   (`Producer.quiesce`: a group's tokens all come from the version it started on,
                   whatever the timing), then applies each bucket to its engine and reads it back;
                   or, with an engine that takes updates in flight (the native engine's
                   `on_weight_update=continue`), stages the buckets while the groups go on and returns
                   once the version has landed between two engine steps (see below)
    StreamProducer (rollout ranks) `grant` whole groups with the oldest policy version they may use,
                   `take` the complete ones (`agent/producer.py`)

Updates in flight. A grant made while the next update trains (`grant(update_follows=True)`) holds that
update's publication to land exactly `rollout.native.update_after_steps` engine steps after the grant
(`NativeEngine.hold_next_update`): the engine runs on until that step, waits there if the weights are
late, and applies them between two steps, each running request going on as a new segment of the new
version. Nothing runs at a grant (a lag of at most 1), so that step, hence which tokens each version
samples, is fixed by the run, not by when the weights arrived. Once no group runs, nothing can reach the
step, and the version lands as soon as it is staged. Counters are read at such a grant (nothing runs
then), not by waiting for the groups in flight to end (which would wait for the update).

The controller calls `RemotePublication.publish` (both ends answer) and `StreamProducer.grant/take`.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from hybridrl.distributed.collectives import Reducer, backend_device
from hybridrl.distributed.dispatch import OneToAll
from hybridrl.distributed.peers import Peers, build_group
from hybridrl.publication import parity
from hybridrl.publication.transport_remote import BroadcastTransport, RemoteTarget, receive_publication
from hybridrl.workers.base import Part, register
from hybridrl.workers.modes import Phases
from hybridrl.workers.publisher import Publisher

PUBLISH_GROUP = "publish"


def publish_ranks(ctx: Any) -> list[int]:
    """Training rank 0 (it holds every bucket whole) and every rollout rank."""
    return [0, *ctx.roles.rollout_ranks]


def _publish_group(ctx: Any):
    timeout = timedelta(seconds=max(ctx.cfg.call_timeout_s, ctx.cfg.init_timeout_s) + 60)
    return build_group(ctx.store, PUBLISH_GROUP, publish_ranks(ctx), ctx.rank, backend=ctx.data_backend,
                       timeout=timeout)


class RemotePublication(Part):
    """Both ends of a publication to separate rollout ranks; `publish` makes them serve `version`."""

    def __init__(self, cfg: Any, ctx: Any, phases: Phases):
        self.cfg, self.ctx, self.phases = cfg, ctx, phases
        self.peers = _publish_group(ctx)            # None on the training ranks but rank 0
        self.everyone = Reducer.over_peers(ctx.control_peers)
        self.first_rollout_rank = ctx.roles.num_train
        self.wire = backend_device(ctx.data_backend, ctx.device)   # the publish group's tensors live here

    @register(dispatch=OneToAll("rank0"))
    def publish(self, *, version: int, step: int) -> dict:
        raise NotImplementedError

    def _changed(self, serving: int, version: int) -> bool:
        """Decided together: some engine does not serve `version` yet (every rank takes part)."""
        return self.everyone.any(serving != version)


class SendingEnd(RemotePublication):
    def __init__(self, cfg: Any, ctx: Any, phases: Phases, train: Any, tokenizer: Any):
        from hybridrl.publication.transport_inprocess import InProcessTransport
        from hybridrl.rollout.follower import FollowerEngine

        super().__init__(cfg, ctx, phases)
        self.publisher = Publisher(cfg, ctx, train.actor, tokenizer)
        # the rollout engines' weight spec, from the first rollout rank to every training rank, so that every
        # training rank takes the same structure decision
        spec = (self.peers.broadcast_object(None, self.first_rollout_rank, device=self.wire)
                if self.peers is not None else None)
        box = [spec]
        dist.broadcast_object_list(box, src=0)       # the training ranks' own world
        if self.peers is not None:                  # the sender: verified copies on the rollout ranks
            self.target = RemoteTarget(box[0])
            self.transport = BroadcastTransport(self.peers, self.target, ctx.device)
        else:                                       # writes its share of the buckets, tracks the version
            self.target = FollowerEngine(box[0], releasable_tags=())
            self.transport = InProcessTransport(self.target)
        self.trainers = Reducer.over_group(None, ctx.device)     # the training ranks' world
        # updates in flight land on running groups: no parity probe (its requests would share their batches)
        self.probes = not cfg.rollout.engine_row.updates_in_flight(cfg)
        self.training_peers = Peers(dist.group.WORLD, ctx.roles.train_ranks, ctx.rank)
        self.loop = asyncio.new_event_loop()

    @register(dispatch=OneToAll("rank0"))
    def publish(self, *, version: int, step: int) -> dict:
        """Publish `version` to the rollout ranks unless every one of them serves it already."""
        if not self._changed(self.target.policy_version, version):
            return {"published": False, "policy_version": version}
        self.phases.switches += 1
        self.phases.arrive("publish")          # every training rank, before the publication's collectives
        refused = None
        with self.phases.phase("publish", waits_for="the weights to reach the rollout ranks") as rec:
            try:
                refused = self.publisher.publish(version, step, target=self.target, transport=self.transport,
                                                 run=self._run, peers=self.training_peers)
            finally:
                if self.peers is not None:
                    self.transport.finish(version)
            rec.bytes_moved = self.publisher.stats.bytes_copied if refused is None else 0
        published = refused is None
        probe = {}
        if published and self.probes and self.publisher.probe_due(version):
            with self.phases.phase("probe", waits_for="the parity probe"):
                probe = self.publisher.check_parity(version, self._probe_outputs(), lambda v: self.trainers.max([v])[0])
        if published:
            probe["parity/probed"] = float("parity/max_abs" in probe)
        out = {"published": published, "policy_version": self.target.policy_version, **probe,
               "publish/refused": float(not published), "switch/publish_s": self.phases.last()["publish"]["seconds"]}
        return {**out, **self.publisher.release_metrics(published)}

    def _run(self, coro, waits_for: str):
        return self.phases.bounded(self.loop.run_until_complete, coro, waits_for)

    def _probe_outputs(self) -> list:
        """The first rollout rank's probe generations, to every training rank."""
        box = [self.peers.broadcast_object(None, self.first_rollout_rank, device=self.wire)
               if self.peers is not None else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def memory(self) -> dict:
        return self.publisher.memory()


class ReceivingEnd(RemotePublication):
    def __init__(self, cfg: Any, ctx: Any, phases: Phases, rollout: Any, producer: "StreamProducer"):
        super().__init__(cfg, ctx, phases)
        self.rollout, self.producer = rollout, producer
        self.engine = rollout.engine
        tags = self.engine.releasable_tags          # a rollout rank always serves: a fresh KV cache, kept
        rollout.run(self.engine.sleep(tags))
        rollout.run(self.engine.wake_up(tags))
        self.peers.broadcast_object(self.engine.weight_spec() if ctx.rank == self.first_rollout_rank else None,
                                    self.first_rollout_rank, device=self.wire)
        special = [t for t in (rollout.tokenizer.eos_token_id, rollout.tokenizer.pad_token_id) if t is not None]
        n = cfg.publish.parity_prompts
        self.probe = parity.probe_prompts(len(rollout.tokenizer), n, avoid=special) if n else []
        self.schedule = parity.ProbeSchedule(cfg.publish.parity_every)

    @register(dispatch=OneToAll("rank0"))
    def publish(self, *, version: int, step: int) -> dict:
        """Receive `version` from training rank 0 once the running groups have ended, or while they run when
        the engine takes updates in flight (see the module doc)."""
        producer = self.producer.producer
        if self.producer.in_flight:
            producer.poke()
        else:
            with self.phases.phase("quiesce", waits_for="the running groups to end on their version"):
                producer.quiesce(aborted=self.ctx.control.aborted)
        if not self._changed(self.engine.policy_version, version):
            self.producer.no_update()
            return {}
        self.phases.switches += 1
        self.phases.arrive("publish")          # every rollout rank, before the publication's collectives
        with self.phases.phase("publish", waits_for="the weights from training rank 0") as rec:
            got = receive_publication(self.peers, self.engine, self.rollout.run, src=0, device=self.ctx.device,
                                     takes_buckets=self.rollout.row.loads_flat_buckets, served=self._served)
            rec.bytes_moved = got["bytes"]
        if got["error"] is not None:
            raise got["error"]
        if self.producer.in_flight and self.engine.staged_version == version:
            with self.phases.phase("land", waits_for="the update's engine step"):
                self.rollout.run(self.producer.landed(version))
        if (self.engine.policy_version == version and self.probe and not self.producer.in_flight
                and self.schedule.due(version)):
            with self.phases.phase("probe", waits_for="the parity probe"):
                outputs = None
                if self.ctx.rank == self.first_rollout_rank:
                    outputs = self.rollout.probe(self.probe, self.cfg.publish.parity_tokens, tag=f"v{version}")
                self.peers.broadcast_object(outputs, self.first_rollout_rank, device=self.wire)
        return {}

    def _served(self) -> int:
        """The version this rank tells the sender it holds: staged whole counts (it lands at its step)."""
        return self.engine.staged_version if self.producer.in_flight else self.engine.policy_version


class StreamProducer(Part):
    """A rollout rank's continuous collection: granted groups run on the engine's loop thread."""

    def __init__(self, ctx: Any, rollout: Any):
        from hybridrl.agent.producer import Producer

        self.ctx, self.rollout = ctx, rollout
        self.producer = Producer(rollout.runner, rollout.task, rollout.loop)
        cfg = rollout.cfg
        self.in_flight = cfg.rollout.engine_row.updates_in_flight(cfg)     # updates land on running groups
        self.after_steps = cfg.rollout.engine_section.update_after_steps if self.in_flight else 0
        self.update_due = False                   # a grant was made for groups an update will land on
        self._counters: dict | None = None        # in_flight: the engine and agent counters at the last grant
        rollout.settle = self._settle             # before counters are read
        if self.in_flight:                        # the groups an update landed on may still run at a validation
            rollout.alone = lambda: self.producer.quiesce(aborted=ctx.control.aborted, start=False)
        self._last: dict[str, float] | None = None       # the counters at the last take

    def _settle(self) -> dict | None:
        """What `RolloutSide.rollout_stats` reads: with an update due to land on the running groups, the
        counters at the grant that started them (waiting for the groups would wait for the update); else
        None, once no group runs."""
        if self.update_due:
            return self._counters
        self.producer.quiesce(aborted=self.ctx.control.aborted)
        return None

    async def _hold(self) -> None:
        """On the loop, at the grant: the next update lands `after_steps` engine steps from here."""
        engine = self.rollout.engine
        await engine.hold_next_update(engine.steps + self.after_steps if self.after_steps else None)

    async def landed(self, version: int) -> None:
        """Until the engine serves `version` (staged whole): at its step while groups run; once none runs,
        at once (nothing can reach the step any more)."""
        engine = self.rollout.engine
        served = asyncio.ensure_future(engine.serving(version))      # raises if applying it failed
        released = False
        while not served.done():
            if not released and not self.producer.running():
                await engine.hold_next_update(None)
                released = True
            await asyncio.wait({served}, timeout=0.002)
        served.result()
        self.update_due = False

    def no_update(self) -> None:
        """The step did not update: the groups run on, on the version they have (the hold is dropped)."""
        if self.update_due:
            self.rollout.run(self.rollout.engine.hold_next_update(None))
            self.update_due = False

    def _mine(self, groups: list) -> list:
        """Whole groups dealt to the rollout ranks in turn: group i to rollout rank i % R."""
        mesh = self.rollout.mesh
        return [g for i, g in enumerate(groups) if i % mesh.dp_size == mesh.dp_rank(self.ctx.rank)]

    @register(dispatch=OneToAll(mesh="rollout"))
    def grant(self, *, groups: list[list[dict]], floor: int, update_follows: bool = False) -> None:
        """Groups (each: its episodes' instance, attempt, group_id) to run once the engine serves a
        version >= `floor`. `update_follows`: the next publication comes while they may run (it lands on
        them at a fixed engine step when updates go in flight)."""
        from hybridrl.data.episode import TaskInstance

        mine = [[(TaskInstance.from_dict(e["instance"]), int(e["attempt"]), e["group_id"]) for e in group]
                for group in self._mine(groups)]
        hold = self.in_flight and update_follows
        if hold:                 # nothing runs at a grant (a lag of at most 1): the counters are exact here
            self._counters = self.rollout.counters()
        self.producer.grant(mine, floor, before=self._hold if hold else None)
        self.update_due = self.update_due or hold

    @register(dispatch=OneToAll(mesh="rollout"))
    def take(self, *, group_ids: list[str], floor: int, settle: bool = False) -> dict:
        """This rank's complete groups among `group_ids` (waiting until they are), scored by the reward
        model when there is one; `floor` lowers what waiting groups need (a step without an update leaves
        the version where it was). `settle` (a checkpoint): no update lands on them first, they end on the
        version they run on."""
        if settle:
            self.no_update()
        self.producer.lower_floor(floor)
        with self.rollout.phases.phase("take"):
            trajectories = self.producer.take(self._mine(group_ids), aborted=self.ctx.control.aborted)
        self.rollout.stamp(trajectories)
        self.rollout.score(trajectories)
        return {"trajectories": trajectories, "stats": self._since_last_take()}

    def _since_last_take(self) -> dict:
        """The producer's counters since the last take (its first: since it started), and its gauges."""
        now = self.producer.stats()
        last = self._last or {k: 0.0 for k in ("idle_s", "floor_waits", "launched_groups", "policy_tokens")}
        out = {**now, **{k: now[k] - last[k] for k in last}, "first": self._last is None,
               "clock_s": now["clock"] - (self._last["clock"] if self._last is not None else self.producer.started)}
        self._last = now
        return out

    def close(self) -> None:
        self.rollout.run(_cancel_episodes())


async def _cancel_episodes() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
