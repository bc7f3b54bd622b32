"""`ModeSwitch`: the colocated placement's link between a rank's two sides. Training and generation
time-share the rank's device, so the rank is a state machine (`workers/modes.py`):

    TRAIN --enter_rollout--> RESHARD --(publish)--> ROLLOUT --enter_train--> TRAIN
            offload optimizer/grads   wake weights,    generate   engine sleeps (all its tags:
            (CPU: optional spill)     publish, verify, episodes   KV cache; SGLang weights and
                                      wake KV, probe              CUDA graphs too), reload

- enter_rollout: offload optimizer state and gradients, publish the actor's weights into the engine
  through the engine's own colocated transport (structure check, verification, bucketed in-place copy,
  manifest), wake the engine, run the logprob parity probe. Who publishes is decided together: every
  rank takes part in the publication's collectives, so "my engine does not serve this version" is
  each rank's vote at the switch's arrival barrier, and one vote makes every rank publish.
- enter_train: the engine releases its memory, optimizer state and gradients come back.

Every phase has a deadline (`hybrid.*_deadline_s`). Each switch starts with an arrival barrier, so a rank
that stops coming is named instead of waited for inside a collective (entering ROLLOUT, the barrier also
decides who publishes); work that cannot be interrupted is covered by a backstop that reports the phase
as this rank's error and aborts the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hybridrl.distributed.collectives import Reducer
from hybridrl.distributed.control import ErrorReport
from hybridrl.distributed.dispatch import OneToAll
from hybridrl.publication.agree import Verdict, verdict_of
from hybridrl.publication.manifest import PublicationError
from hybridrl.rollout.protocol import WEIGHTS
from hybridrl.workers.base import Part, register
from hybridrl.workers.modes import Mode, ModeMachine
from hybridrl.workers.publisher import Publisher
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.train_side import TrainSide

log = logging.getLogger(__name__)


class ModeSwitch(Part):
    def __init__(self, cfg: Any, ctx: Any, modes: ModeMachine, train: TrainSide, rollout: RolloutSide):
        self.cfg, self.ctx, self.modes, self.train, self.rollout = cfg, ctx, modes, train, rollout
        self.engine = rollout.engine
        self.transport = rollout.row.colocated_transport(self.engine, rollout.group_ranks, rollout.group)
        self.publisher = Publisher(cfg, ctx, train.actor, rollout.tokenizer)
        self.everyone = Reducer.over_peers(ctx.control_peers)
        rollout.run(self.engine.sleep(self.engine.releasable_tags))     # start in TRAIN: the engine holds nothing
        self._lent: dict[str, int] | None = None        # what the engine serves in place: name -> address
        if rollout.owns_engine and rollout.row.shares_trainer_weights(cfg):
            self._lend(train.actor.hf_views())

    def _lend_again_if_moved(self) -> None:
        """Lend the parameters again where the trainer re-allocated one since they were lent."""
        views = self.train.actor.hf_views()
        if any(views[name].data_ptr() != address for name, address in self._lent.items()):
            self._lend(views)

    def _lend(self, views: dict) -> None:
        """The engine serves the trainer's parameters (`actor.hf_views()`) where their layout is its own (its row
        says whether this run's engines do: `rollout.native.trainer_weights`)."""
        shared = self.rollout.run(self.engine.share_weights(views))
        self._lent = {name: t.data_ptr() for name, t in views.items()} if shared else None
        if shared:
            log.info("rank %d: the rollout engine serves %.1f MiB of the trainer's parameters in place",
                     self.ctx.rank, shared / 2**20)

    @register(dispatch=OneToAll("rank0"))
    def mode(self) -> str:
        return self.modes.mode.value

    @register(dispatch=OneToAll("rank0"))
    def enter_rollout(self, *, version: int, step: int) -> dict:
        """TRAIN -> RESHARD -> ROLLOUT; publishes `version` unless every rank's engine already serves it.
        Already in ROLLOUT serving `version` (e.g. after a validation): nothing to do."""
        if self.modes.mode == Mode.ROLLOUT and self.engine.policy_version == version:
            return {"published": False, "policy_version": version}
        self.modes.to(Mode.RESHARD)
        self.modes.switches += 1
        tags = self.engine.releasable_tags
        refused = None
        try:
            # every rank arrives with its votes, and the ranks decide there together: who publishes (a rank
            # whose engine forgot its weights, as SGLang releases them, and one whose engine kept them, as
            # a validation left it serving, must both take part in the publication's collectives), and
            # whether the publication is refused before anything moves (`publication/agree.py`)
            votes = self.modes.arrive("offload", vote={
                "stale": self.engine.policy_version != version,
                "refusal": self.publisher.refusal(self.engine)})
            published = any(v["stale"] for v in votes.values())
            self.train.offload()
            if self._lent is not None:
                self._lend_again_if_moved()
            with self.modes.phase("publish", waits_for="the weights to reach the rollout engine") as rec:
                if published:
                    if tags & {WEIGHTS}:
                        self._engine_call(self.engine.wake_up({WEIGHTS}), "the engine to take its weights back")
                    refused = self._publish(version, step, verdict_of({r: v["refusal"] for r, v in votes.items()}))
                    rec.bytes_moved = self.publisher.stats.bytes_copied if refused is None else 0
                    published = refused is None
            with self.modes.phase("wake", waits_for="the rollout engine to wake up"):
                if tags - {WEIGHTS}:
                    self._engine_call(self.engine.wake_up(tags - {WEIGHTS}), "the engine to take its memory back")
            probe, phases = {}, ["offload", "publish", "wake"]
            if published and self.publisher.probe_due(version):     # a check after the switch, timed apart
                with self.modes.phase("probe", waits_for="the parity probe"):
                    probe = self._parity_probe(version)
                phases.append("probe")
            if published:
                probe["parity/probed"] = float("probe" in phases)
        except BaseException:
            self.modes.to(Mode.TRAIN)
            self._back_to_train(tags)
            raise
        self.modes.to(Mode.ROLLOUT)
        out = {"published": published, "policy_version": self.engine.policy_version, **probe,
               # every rank took the same decision (publication/agree.py): nothing to count over them
               "publish/refused": float(refused is not None),
               **self._timed(phases, "switch/arrival_rollout_s")}
        return {**out, **self.publisher.release_metrics(published)}

    def _timed(self, phases: list[str], arrival_key: str) -> dict[str, float]:
        """Seconds of the phases this switch ran, and of the waits at their arrival barriers (`arrival_key`)."""
        last = self.modes.last()
        return {**{f"switch/{k}_s": last[k]["seconds"] for k in phases},
                arrival_key: sum(last[k]["arrival_s"] for k in phases)}

    def _publish(self, version: int, step: int, verdict: Verdict) -> str | None:
        """Publish `version` into this rank's engine; returns why it was refused (None: published). Every rank
        decided together (`verdict`, at the switch's arrival), before any copy, so the engines still serve
        what they had."""
        refused = self.publisher.publish(version, step, target=self.engine, transport=self.transport,
                                         run=self._engine_call, verdict=verdict)
        if refused is not None and self.engine.policy_version < 0:
            raise PublicationError(f"publication v{version} refused ({refused}) and the engine holds no "
                                   "weights to fall back on (SGLang releases them between rollouts): nothing to serve")
        return refused

    def _parity_probe(self, version: int) -> dict:
        """Engine greedy logprobs vs the trainer's on fixed prefixes; raises above the tolerance."""
        outputs = (self.rollout.probe(self.publisher.probe, self.cfg.publish.parity_tokens, tag=f"v{version}")
                   if self.rollout.owns_engine else None)
        if self.rollout.group is not None:   # the group's engine answered on its owner: share it
            import torch.distributed as dist

            box = [outputs]
            dist.broadcast_object_list(box, src=self.rollout.group_ranks[0], group=self.rollout.group)
            outputs = box[0]
        return self.publisher.check_parity(version, outputs, lambda v: self.everyone.max([v])[0])

    @register(dispatch=OneToAll("rank0"))
    def enter_train(self) -> dict:
        """ROLLOUT -> TRAIN: the engine releases its memory (KV cache; SGLang its weights and CUDA graphs
        too), optimizer state and gradients return."""
        self.modes.require(Mode.ROLLOUT)
        self.modes.switches += 1
        self.modes.arrive("sleep")
        with self.modes.phase("sleep", waits_for="the rollout engine to drain and release its memory"):
            self._engine_call(self.engine.sleep(self.engine.releasable_tags), "the engine to drain and release")
        self.train.reload()
        self.modes.to(Mode.TRAIN)
        return self._timed(["sleep", "reload"], "switch/arrival_train_s")

    def _back_to_train(self, tags) -> None:
        """After a failed switch: release what the engine took, bring training state back (bounded)."""
        try:
            self.rollout.run(asyncio.wait_for(self.engine.sleep(tags), self.cfg.hybrid.drain_deadline_s))
        except Exception as err:  # noqa: BLE001 - the switch's own error is the one to report
            log.error("rank %d: the engine did not go back to sleep after a failed switch: %r", self.ctx.rank, err)
        self.train.reload(timed=False)

    def _engine_call(self, coro, waits_for: str):
        return self.modes.bounded(self.rollout.run, coro, waits_for)

    @register(dispatch=OneToAll("rank0"))
    def phase_summary(self) -> dict:
        return self.modes.summary()

    def memory(self) -> dict:
        return {"mode": self.modes.mode.value, **self.publisher.memory()}


def report_overrun(ctx: Any):
    """A phase ran past its deadline where it cannot be interrupted (a collective, an offload): report it
    as this rank's error and abort the run, so that every rank exits (called from a timer thread)."""
    def overrun(message: str) -> None:
        control = ctx.control.clone()
        control.report_error(ErrorReport(ctx.rank, "mode switch", "timeout", message, "", time.time()))
        control.abort(message)
    return overrun
