"""`HybridWorker`: one rank's Megatron actor (+ frozen reference) and rollout engine, time-shared.

    TRAIN --enter_rollout--> RESHARD --(publish)--> ROLLOUT --enter_train--> TRAIN

- enter_rollout: offload optimizer state and gradients (on a CPU device optimizer state can be
  spilled to a file), publish the actor's weights into the engine (structure check, verification,
  bucketed in-place copy, manifest), wake the engine (KV cache), run the logprob parity probe.
- rollout: this rank's share of the step's episodes (one row per episode) through the agent loop
  on this rank's engine; returns them as token-aligned tensors + per-row records.
- collect (partial rollouts): launch new groups, run every episode this rank holds until enough
  groups are complete over all ranks, interrupt the rest at a token boundary and keep them for
  the next step (`agent/collector.py`); returns the complete groups as trajectories.
- enter_train: the engine sleeps (KV cache released), optimizer state and gradients come back.
- update_policy: the whole training side of a step in one call, on this rank's share of the
  batch (reference and old logprobs as needed, KL-in-reward, advantages exact over the
  data-parallel ranks, ppo_epochs x mini-batches optimizer steps); returns scalars and per-row
  values (`workers/policy_update.py`). compute_logprobs / compute_ref_logprobs / train_step: the
  single pieces (tests, probes).

Every phase is timed with its bytes and peak memory (`ModeMachine`); an illegal call order raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.algo.objective import make_loss_fn
from hybridrl.distributed.dispatch import ONE_TO_ALL, DPSplit, OneToAll
from hybridrl.data.batch import Batch
from hybridrl.data.trajectory import to_batch
from hybridrl.distributed.mesh import Mesh
from hybridrl.publication import parity
from hybridrl.distributed.control import ErrorReport
from hybridrl.publication.buckets import Staging
from hybridrl.publication.manifest import PublicationError, PublicationRefused, model_hashes
from hybridrl.publication.publish import publish
from hybridrl.rollout.protocol import WEIGHTS
from hybridrl.workers.base import Worker, register
from hybridrl.workers.critic import CriticMixin
from hybridrl.workers.faults import FaultMixin
from hybridrl.workers.policy_update import PolicyUpdateMixin
from hybridrl.workers.reward_model import RewardModelMixin
from hybridrl.workers.modes import Arrivals, Mode, ModeMachine, PhaseTimeout

log = logging.getLogger(__name__)

# per-token tensors of a rollout: padded on the sequence dim when shards are put together
ROLLOUT_PADS = (("input_ids", 0), ("attention_mask", 0), ("loss_mask", 0.0), ("behavior_logprobs", 0.0),
                ("policy_version", -1), ("routed_experts", -1))       # (MoE: the routing record, -1 = none)


class HybridWorker(PolicyUpdateMixin, CriticMixin, RewardModelMixin, FaultMixin, Worker):
    def __init__(self, cfg: Any, ctx: Any):
        super().__init__(ctx)
        self.cfg = cfg
        self.modes = ModeMachine(ctx.device, rank=ctx.rank, deadlines=cfg.hybrid.deadlines(),
                                 arrivals=Arrivals(ctx.control.store, ctx.rank, self.switch_ranks(),
                                                   aborted=ctx.control.aborted),
                                 on_overrun=self._overrun, overrun_grace_s=max(2.0, ctx.cfg.error_grace_s))
        self.loop = self._event_loop()
        self._build_training()
        self._build_rollout()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop the engines' coroutines run on (SGLang's tokenizer manager binds to its first loop)."""
        return asyncio.new_event_loop()

    def switch_ranks(self) -> list[int]:
        """The ranks that run every phase of this worker's mode switches (their arrivals are awaited)."""
        return list(range(self.ctx.world_size))

    def _build_training(self) -> None:
        """The Megatron actor (+ a frozen reference with a KL term, + a critic for GAE) and its losses."""
        from hybridrl.backends.megatron import MegatronEngine, moe

        cfg, ctx = self.cfg, self.ctx
        self.actor = MegatronEngine.from_hf(cfg.model.path, cfg.train, training=True, device=ctx.device)
        moe.set_mode(self.actor.model, cfg.algo.router_replay)       # MoE routing replay (no-op for dense models)
        self.ref = (MegatronEngine.from_hf(cfg.model.path, cfg.train, training=False, device=ctx.device)
                    if cfg.algo.uses_reference else None)
        self.critic = self._build_critic()            # algo.advantage=gae only (hybridrl/workers/critic.py)
        self.loss_fn = make_loss_fn(cfg.algo)
        self.on_policy_loss_fn = make_loss_fn(cfg.algo, old_from_forward=True)
        self.spill_dir = Path(cfg.run.dir) / "offload" / f"rank{ctx.rank}" if cfg.hybrid.spill_optimizer else None

    def _build_rollout(self) -> None:
        """The rollout engine (or its stand-in), the publication path into it, and the agent loop."""
        from transformers import AutoTokenizer

        from hybridrl.agent.loop import AgentRunner
        from hybridrl.agent.tools.base import ToolBox
        from hybridrl.envs.tasks import get_task

        cfg, ctx = self.cfg, self.ctx
        rollout_mesh = self.meshes()["rollout"]
        self.rollout_ranks = rollout_mesh.group_along("tp", ctx.rank)
        self.owns_engine = ctx.rank == self.rollout_ranks[0]
        self.rollout_group = None
        if cfg.rollout.tp > 1:   # every rank creates every group, in the same order
            for ranks in rollout_mesh.groups_along("tp"):
                group = dist.new_group(ranks, backend="gloo")
                if ctx.rank in ranks:
                    self.rollout_group = group
        self.engine = self._build_engine()
        self.transport = self._build_transport()
        self.staging = Staging(ctx.device)
        self.hashes = model_hashes(cfg.model.path)
        self.release = None
        self._publish_stats = None
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.reward_model = self._build_reward_model()   # reward_model.path (hybridrl/workers/reward_model.py)
        self.task = get_task(cfg.task.name, cfg.task)
        tool_names = sorted({t for inst in self.task.validation_split(8) for t in inst.tools})
        self.tools = self._run(ToolBox.from_config(cfg.tools, names=tool_names).start())
        self.runner = AgentRunner(self.engine, self.tokenizer, agent_cfg=cfg.agent, tools=self.tools,
                                  run_id=cfg.run.name, seed=cfg.run.seed, envs=self._env_provider())
        self.collector = None              # partial rollouts: episodes kept across steps (built on first use)
        self._run(self.engine.sleep(self.engine.releasable_tags))     # start in TRAIN: the engine holds nothing
        self._probe = self._probe_prompts()

    def _probe_prompts(self) -> list:
        special = [t for t in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id) if t is not None]
        n = self.cfg.publish.parity_prompts
        return parity.probe_prompts(len(self.tokenizer), n, avoid=special) if n else []

    # ------------------------------------------------------------------ construction

    def _env_provider(self):
        """A stateful task's episodes go through the leased environment service (one SQLite file per
        run, shared by every rollout rank): each action has an idempotency key from (run, task,
        group@step, attempt, turn), so after a resume the actions the crashed run committed are
        answered from the record, never executed again. Tool-only tasks need none."""
        from hybridrl.envs.tasks.base import Task

        if type(self.task).make_env is Task.make_env or not self.owns_engine:
            return None
        from hybridrl.envs.client import LeasedEnvProvider
        from hybridrl.envs.service import EnvService

        return LeasedEnvProvider(EnvService.from_config(self.cfg.env), self.cfg.env)

    def _build_engine(self):
        """The rollout group's engine on its first rank; a FollowerEngine on the others."""
        rollout = self.cfg.rollout
        if not self.owns_engine:
            from hybridrl.backends.native import NativeEngine
            from hybridrl.rollout.follower import FollowerEngine

            # the stand-in releases what the group's engine releases, so both forget the version together
            tags = rollout.sglang.releasable_tags() if rollout.engine == "sglang" else NativeEngine.releasable_tags
            return FollowerEngine(self.actor.hf_spec(), eos_token_ids=(), vocab_size=self.actor.adapter.spec.vocab_size,
                                  max_model_len=0, releasable_tags=tags,
                                  policy_version=-1 if rollout.engine == "sglang" else 0)
        if rollout.engine == "native":
            from hybridrl.backends.native import NativeEngine

            if rollout.tp > 1:
                log.warning("the native engine has no tensor parallelism: with rollout.tp=%d one replica on rank "
                            "%d serves its group of %d ranks", rollout.tp, self.ctx.rank, rollout.tp)
            return NativeEngine.from_pretrained(self.cfg.model.path, rollout.native, device=self.ctx.device)
        from hybridrl.backends.sglang.engine import SGLangEngine

        return SGLangEngine(self.cfg.model.path, rollout.sglang, tp_size=rollout.tp,
                            base_gpu_id=self.ctx.local_rank, port_offset=self.ctx.rank, seed=self.cfg.run.seed,
                            drain_timeout_s=self.cfg.hybrid.drain_deadline_s)

    def _build_transport(self):
        if self.cfg.rollout.engine == "sglang":
            from hybridrl.backends.sglang.transport import CudaIpcTransport

            return CudaIpcTransport(self.engine, self.rollout_ranks, self.rollout_group)
        from hybridrl.publication.transport_inprocess import InProcessTransport

        return InProcessTransport(self.engine)

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    def meshes(self) -> dict[str, Mesh]:
        world, rtp = self.ctx.world_size, self.cfg.rollout.tp
        return {"world": Mesh.flat("world", world), "train": self.actor.mesh,
                "rollout": Mesh("rollout", ("dp", "tp"), (world // rtp, rtp))}

    # ------------------------------------------------------------------ mode switches

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
            with self.modes.phase("offload") as rec:
                rec.bytes_moved = self.actor.offload(optimizer=True, grads=True, spill_dir=self.spill_dir)
            self._offload_critic()
            with self.modes.phase("publish", waits_for="the weights to reach the rollout engine") as rec:
                # decided together: a rank whose engine forgot its weights (SGLang releases them) and one
                # whose engine kept them (a validation left it serving) must both take part
                published = self._any_rank(self.engine.policy_version != version)
                if published:
                    self._engine_call(self.engine.wake_up(tags & {WEIGHTS}), "the engine to take its weights back")
                    refused = self._publish(version, step)
                    rec.bytes_moved = self._publish_stats.bytes_copied if refused is None else 0
                    published = refused is None
            with self.modes.phase("wake", waits_for="the rollout engine to wake up"):
                self._engine_call(self.engine.wake_up(tags - {WEIGHTS}), "the engine to take its memory back")
            probe = {}
            if published and self._probe:       # a check after the switch, timed apart from it
                with self.modes.phase("probe", waits_for="the parity probe"):
                    probe = self._parity_probe(version)
        except BaseException:
            self.modes.to(Mode.TRAIN)
            self._back_to_train(tags)
            raise
        self.modes.to(Mode.ROLLOUT)
        out = {"published": published, "policy_version": self.engine.policy_version, **probe,
               "publish/refused": self._count_refusals(refused is not None),
               **{f"switch/{k}_s": v["seconds"] for k, v in self.modes.last().items()
                  if k in ("offload", "publish", "wake")}}
        return {**out, **self._release_metrics(published)}

    def _release_metrics(self, published: bool) -> dict:
        """The release a publication made (manifest summary) and where its time went."""
        if not published or self.release is None:
            return {}
        stats = self._publish_stats
        return {"release": self.release.summary(), "switch/publish_prepare_s": stats.prepare_s,
                "switch/publish_deliver_s": stats.deliver_s, "publish/retried_tensors": float(stats.retries)}

    def _publish(self, version: int, step: int) -> str | None:
        """Publish `version` into this rank's engine; returns why it was refused (None: published).
        A refusal happens before any copy, so the engine still serves what it had."""
        previous, refused = self.engine.policy_version, None
        try:
            self.release, self._publish_stats = self._engine_call(publish(
                self.actor, engine=self.engine, transport=self.transport, cfg=self.cfg.publish, version=version,
                step=step, hashes=self.hashes, staging=self.staging), "the weights to reach the rollout engine")
        except PublicationRefused as err:
            refused = str(err)
            log.error("rank %d: %s", self.ctx.rank, err)
        if self.ctx.device.type == "cuda":
            self.staging.release()                    # the bucket buffers' memory goes to the KV cache
        if self.rollout_group is not None and self._any_in_group(refused is not None) and refused is None:
            # the group's engine refused it on its owner: this rank's stand-in stays where the owner is
            refused = "refused by the rollout group's engine"
            self.engine.rollback(previous)
        if refused is not None and self.engine.policy_version < 0:
            raise PublicationError(f"publication v{version} refused ({refused}) and the engine holds no "
                                   "weights to fall back on (SGLang releases them between rollouts): nothing to serve")
        return refused

    @register(dispatch=OneToAll("rank0"))
    def enter_train(self) -> dict:
        """ROLLOUT -> TRAIN: the engine releases its memory (KV cache; SGLang its weights and CUDA graphs
        too), optimizer state and gradients return."""
        self.modes.require(Mode.ROLLOUT)
        self.modes.switches += 1
        with self.modes.phase("sleep", waits_for="the rollout engine to drain and release its memory"):
            self._engine_call(self.engine.sleep(self.engine.releasable_tags), "the engine to drain and release")
        with self.modes.phase("reload") as rec:
            rec.bytes_moved = self.actor.reload()
        self._reload_critic()
        self.modes.to(Mode.TRAIN)
        return {f"switch/{k}_s": v["seconds"] for k, v in self.modes.last().items() if k in ("sleep", "reload")}

    def _back_to_train(self, tags) -> None:
        """After a failed switch: release what the engine took, bring training state back (bounded)."""
        try:
            self._run(asyncio.wait_for(self.engine.sleep(tags), self.cfg.hybrid.drain_deadline_s))
        except Exception as err:  # noqa: BLE001 - the switch's own error is the one to report
            log.error("rank %d: the engine did not go back to sleep after a failed switch: %r", self.ctx.rank, err)
        self.actor.reload()
        self._reload_critic()

    def _engine_call(self, coro, waits_for: str):
        """Run an engine coroutine within what is left of the current phase's deadline."""
        remaining = self.modes.remaining()
        try:
            return self._run(asyncio.wait_for(coro, remaining) if remaining is not None else coro)
        except asyncio.TimeoutError:
            raise PhaseTimeout(self.modes.timeout_message(waits_for)) from None

    def _overrun(self, message: str) -> None:
        """A phase ran past its deadline where it cannot be interrupted (a collective, an offload): report
        it as this rank's error and abort the run, so that every rank exits (from a timer thread)."""
        control = self.ctx.control.clone()
        control.report_error(ErrorReport(self.ctx.rank, "mode switch", "timeout", message, "", time.time()))
        control.abort(message)

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
        self.ctx.control_peers.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _any_in_group(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.rollout_group)
        return bool(t.item())

    def _count_refusals(self, refused: bool) -> float:
        """How many ranks refused this publication (every rank takes part: enter_rollout is SPMD)."""
        flag = torch.tensor([1.0 if refused else 0.0], dtype=torch.float64)
        self.ctx.control_peers.all_reduce(flag)
        return float(flag)

    def _parity_probe(self, version: int) -> dict:
        """Engine greedy logprobs vs the trainer's on fixed prefixes; raises above the tolerance."""
        outputs = (self._run(parity.engine_outputs(self.engine, self._probe, self.cfg.publish.parity_tokens,
                                                   tag=f"v{version}")) if self.owns_engine else None)
        if self.rollout_group is not None:   # the group's engine answered on its owner: share it
            box = [outputs]
            dist.broadcast_object_list(box, src=self.rollout_ranks[0], group=self.rollout_group)
            outputs = box[0]
        return self._check_parity(version, outputs, self._max_over_ranks)

    def _check_parity(self, version: int, outputs: list, reduce_max) -> dict:
        """The trainer's logprobs of the engine's probe generations (every rank of the train mesh takes
        part); the worst difference over the ranks (`reduce_max`) above the tolerance fails the publication."""
        batch = parity.probe_batch(self._probe, outputs)
        mine = self.actor.compute_logprobs(batch)
        result = parity.compare(self._probe, outputs, mine["logprobs"]) if mine is not None else {}
        result["parity/max_abs"] = reduce_max(result.get("parity/max_abs", 0.0))
        if result["parity/max_abs"] > self.cfg.publish.parity_tolerance:
            raise PublicationError(f"parity probe after publishing v{version}: engine and trainer logprobs differ "
                                   f"by {result['parity/max_abs']:.3g} > publish.parity_tolerance="
                                   f"{self.cfg.publish.parity_tolerance}")
        return result

    def _max_over_ranks(self, value: float) -> float:
        worst = torch.tensor([value], dtype=torch.float64)
        self.ctx.control_peers.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst)

    # ------------------------------------------------------------------ rollout

    @register(dispatch=DPSplit("rollout", pad_outputs=ROLLOUT_PADS))
    def rollout(self, episodes: Batch, *, temperature: float | None = None) -> Batch:
        """One row per episode (meta: instance, attempt, group_id) -> one row per trajectory."""
        self.modes.require(Mode.ROLLOUT)
        if not self.owns_engine:
            return None                  # the group's first rank runs its episodes
        return self._episodes(episodes, temperature)

    def _episodes(self, episodes: Batch, temperature: float | None) -> Batch:
        """This rank's share of episodes through the agent loop, scored by the reward model if any."""
        from hybridrl.data.episode import TaskInstance

        real = episodes.num_valid
        if real == 0:   # a shard of padding only (more rollout ranks than episodes)
            return _placeholder_rows(len(episodes))
        attempts = [(TaskInstance.from_dict(episodes["instance"][i]), int(episodes["attempt"][i]),
                     episodes["group_id"][i]) for i in range(real)]
        with self.modes.phase("generate"):
            trajectories = self._run(self.runner.run_attempts(attempts, task=self.task, temperature=temperature))
        self._score_with_reward_model(trajectories)
        return to_batch(trajectories, pad_id=self.tokenizer.pad_token_id or 0).pad_to(len(episodes))

    @register(dispatch=ONE_TO_ALL)
    def collect(self, *, episodes: list[dict], quorum: int, deadline_s: float = 0.0, poll_s: float = 0.05,
                informative_only: bool = False) -> dict:
        """Partial rollouts: `episodes` (instance, attempt, group_id; the step's new ones, whole groups)
        are launched on the engines, group i on rollout dp rank i % dp; every held episode runs until
        `quorum` groups are complete over all ranks. Returns this rank's complete groups and counters."""
        from hybridrl.agent.collector import PartialCollector
        from hybridrl.data.episode import TaskInstance

        self.modes.require(Mode.ROLLOUT)
        if self.collector is None:
            self.collector = PartialCollector(self.runner, self.task, self.loop, owns_engine=self.owns_engine,
                                              group_size=self.cfg.trainer.group_size, sum_over_ranks=self._sum)
        mesh = self.meshes()["rollout"]
        groups = list(dict.fromkeys(e["group_id"] for e in episodes))
        mine = {g for i, g in enumerate(groups) if i % mesh.dp_size == mesh.dp_rank(self.ctx.rank)}
        attempts = [(TaskInstance.from_dict(e["instance"]), int(e["attempt"]), e["group_id"])
                    for e in episodes if e["group_id"] in mine]
        with self.modes.phase("generate"):
            trajectories, stats = self.collector.collect(attempts, quorum=quorum, deadline_s=deadline_s,
                                                         poll_s=poll_s, informative_only=informative_only)
        return {"trajectories": trajectories if self.owns_engine else [], "stats": stats.to_dict()}

    def _sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self.ctx.control_peers.all_reduce(t)
        return t.tolist()

    @register(dispatch=ONE_TO_ALL)
    def sample(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0) -> list[dict]:
        """Raw generations of this rank's engine (token ids, logprobs, version): for probes and tests."""
        from hybridrl.rollout.protocol import SamplingParams

        self.modes.require(Mode.ROLLOUT)
        if not self.owns_engine:
            return []
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=0)

        async def go():
            return await asyncio.gather(*[self.engine.generate(p, sampling, f"sample-{self.ctx.rank}-{i}-{id(p)}")
                                          for i, p in enumerate(prompts)])

        return [{"token_ids": o.token_ids, "logprobs": o.logprobs, "policy_version": o.policy_version,
                 "finish_reason": o.finish_reason.value} for o in self._run(go())]

    @register(dispatch=ONE_TO_ALL)
    def memory_report(self) -> dict:
        """What this rank holds now: optimizer state and gradient bytes by accounting, KV cache, RSS."""
        import psutil

        from hybridrl.backends.megatron.offload import held_bytes

        return {"mode": self.modes.mode.value, **held_bytes(self.actor), **self._critic_memory(),
                **self._reward_model_memory(),
                "kv_cache_bytes": int(self.engine.stats().get("kv_cache_bytes", 0)),
                "staging_bytes": self.staging.nbytes,    # publication's bucket buffers (kept on a CPU device)
                "rss_bytes": psutil.Process().memory_info().rss,
                "phases": self.modes.summary()}

    @register(dispatch=ONE_TO_ALL)
    def rollout_stats(self) -> dict:
        """Engine counters and agent-loop counters of this rank (cumulative)."""
        pool = getattr(self.tools, "pool", None)
        return {"engine": dict(self.engine.stats()), "agent": dict(self.runner.counts),
                "sandbox": {"isolation": pool.mode if pool is not None else None}}

    # ------------------------------------------------------------------ state

    @register(dispatch=ONE_TO_ALL)
    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.modes.require(Mode.TRAIN)
        self._check_disk()                  # fault injection: a full disk (hybridrl/workers/faults.py)
        self.actor.save_checkpoint(path, extra)
        self._save_critic(path, extra)

    @register(dispatch=OneToAll("rank0"))
    def load_checkpoint(self, path: str) -> dict:
        self.modes.require(Mode.TRAIN)
        self._load_critic(path)
        return self.actor.load_checkpoint(path)

    @register(dispatch=ONE_TO_ALL)
    def export_hf(self, out_dir: str) -> None:
        self.actor.export_hf(out_dir)

    @register(dispatch=OneToAll("rank0"))
    def phase_summary(self) -> dict:
        return self.modes.summary()

    @register(dispatch=ONE_TO_ALL)
    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        self._run(self.tools.close())
        self.engine.close()


def _placeholder_rows(n: int) -> Batch:
    tensors = {name: torch.full((n, 1), value, dtype=torch.float32 if isinstance(value, float) else torch.long)
               for name, value in ROLLOUT_PADS if name != "routed_experts"}   # (concat fills it in)
    tensors["prompt_len"] = torch.zeros(n, dtype=torch.long)
    tensors["reward"] = torch.zeros(n)
    return Batch(tensors, {k: [None] * n for k in ("trajectory_id", "group_id", "status", "record")}, num_padding=n)
