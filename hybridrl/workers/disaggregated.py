"""The two workers of the disaggregated placement (`placement.mode=disaggregated`).

    TrainerWorker  ranks 0 .. T-1: the Megatron actor (+ reference, + critic), always in TRAIN.
                   `enter_rollout(version)` publishes the actor's weights to the rollout ranks:
                   every training rank writes the flat buckets (the gathers are collective),
                   training rank 0 broadcasts them over the publish group and the receivers verify
                   (`publication/transport_remote.py`); then the parity probe, rescored here.
    RolloutWorker  ranks T .. W-1: a native engine, the agent runner and its tools, on an event
                   loop in a thread of its own (`agent/producer.py`), generating without pause.
                   `grant` gives it whole groups with the oldest policy version they may use,
                   `take` hands back complete groups, `enter_rollout` receives a publication while
                   the episodes keep running (requests in flight finish on their version).

Both classes answer every registered method (the controller's calls reach every rank); each does
its role's part and nothing for the other's. The controller's side is
`controller/collection.py` (`StreamCollection`).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.data.batch import Batch
from hybridrl.distributed.dispatch import ONE_TO_ALL, DPSplit, OneToAll
from hybridrl.distributed.mesh import Mesh, train_mesh
from hybridrl.distributed.peers import build_group
from hybridrl.publication import parity
from hybridrl.publication.transport_remote import BroadcastTransport, RemoteEngine, receive_publication
from hybridrl.workers.base import register
from hybridrl.workers.hybrid import ROLLOUT_PADS, HybridWorker
from hybridrl.workers.modes import Mode

log = logging.getLogger(__name__)

PUBLISH_GROUP = "publish"


def elsewhere(name: str, dispatch, result: Any = None):
    """A registered method that this role answers with (a copy of) `result`: the other role's ranks
    do the work (every call reaches every rank)."""
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return copy.deepcopy(result)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"{name}: done by the other role's ranks; this one answers {result!r}."
    return register(dispatch=dispatch)(method)


def publish_ranks(ctx: Any) -> list[int]:
    """Training rank 0 (it holds every bucket whole) and every rollout rank."""
    return [0, *ctx.roles.rollout_ranks]


def _meshes(cfg: Any, ctx: Any) -> dict[str, Mesh]:
    roles = ctx.roles
    return {"world": Mesh.flat("world", roles.world_size),
            "train": train_mesh(roles.num_train, cfg.train.tp, cfg.train.pp),
            "rollout": Mesh("rollout", ("dp", "tp"), (len(roles.rollout_ranks), 1), first=roles.num_train)}


def _publish_group(ctx: Any):
    from datetime import timedelta

    timeout = timedelta(seconds=max(ctx.cfg.call_timeout_s, ctx.cfg.init_timeout_s) + 60)
    return build_group(ctx.store, PUBLISH_GROUP, publish_ranks(ctx), ctx.rank, backend=ctx.data_backend,
                       timeout=timeout)


class TrainerWorker(HybridWorker):
    """A training rank of the disaggregated placement (see the module doc)."""

    def switch_ranks(self) -> list[int]:
        return self.ctx.roles.train_ranks

    def meshes(self) -> dict[str, Mesh]:
        return _meshes(self.cfg, self.ctx)

    def _build_rollout(self) -> None:
        from transformers import AutoTokenizer

        from hybridrl.publication.buckets import Staging
        from hybridrl.publication.manifest import model_hashes
        from hybridrl.publication.transport_inprocess import InProcessTransport
        from hybridrl.rollout.follower import FollowerEngine

        cfg, ctx = self.cfg, self.ctx
        self.owns_engine, self.rollout_group, self.rollout_ranks = False, None, []
        self.reward_model, self.collector = None, None
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.hashes = model_hashes(cfg.model.path)
        self.staging = Staging(ctx.device)
        self.release, self._publish_stats = None, None
        self.peers = _publish_group(ctx)               # rank 0 only (None on the other training ranks)
        # the rollout engines' weight spec, from the first rollout rank to every training rank, so that
        # every training rank takes the same structure decision
        spec = self.peers.broadcast_object(None, ctx.roles.num_train) if self.peers is not None else None
        box = [spec]
        dist.broadcast_object_list(box, src=0)         # the training ranks' own world
        spec = box[0]
        if self.peers is not None:                     # the sender: verified copies on the rollout ranks
            self.engine = RemoteEngine(spec)
            self.transport = BroadcastTransport(self.peers, self.engine, ctx.device)
        else:                                          # writes its share of the buckets, tracks the version
            self.engine = FollowerEngine(spec, eos_token_ids=(), vocab_size=self.actor.adapter.spec.vocab_size,
                                         max_model_len=0, releasable_tags=())
            self.transport = InProcessTransport(self.engine)
        self._probe = self._probe_prompts()

    # ------------------------------------------------------------------ publication

    @register(dispatch=OneToAll("rank0"))
    def enter_rollout(self, *, version: int, step: int) -> dict:
        """Publish `version` to the rollout ranks unless every one of them serves it already."""
        if not self._any_rank(self.engine.policy_version != version):
            return {"published": False, "policy_version": version}
        self.modes.switches += 1
        refused = None
        with self.modes.phase("publish", waits_for="the weights to reach the rollout ranks") as rec:
            try:
                refused = self._publish(version, step)
            finally:
                if self.peers is not None:
                    self.transport.finish(version)
            rec.bytes_moved = self._publish_stats.bytes_copied if refused is None else 0
        published = refused is None
        probe = {}
        if published and self._probe:
            with self.modes.phase("probe", waits_for="the parity probe"):
                probe = self._check_parity(version, self._probe_outputs(), self._trainers_max)
        out = {"published": published, "policy_version": self.engine.policy_version, **probe,
               "publish/refused": float(not published), "switch/publish_s": self.modes.last()["publish"]["seconds"]}
        return {**out, **self._release_metrics(published)}

    def _probe_outputs(self) -> list:
        """The first rollout rank's probe generations, to every training rank."""
        box = [self.peers.broadcast_object(None, self.ctx.roles.num_train) if self.peers is not None else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _trainers_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=_reduce_device(self.ctx))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    @register(dispatch=OneToAll("rank0"))
    def enter_train(self) -> dict:
        return {}           # a training rank never leaves TRAIN

    # ------------------------------------------------------------------ what only rollout ranks do

    rollout = elsewhere("rollout", DPSplit("rollout", pad_outputs=ROLLOUT_PADS))
    grant = elsewhere("grant", ONE_TO_ALL)
    take = elsewhere("take", ONE_TO_ALL, {"trajectories": [], "stats": {}})
    sample = elsewhere("sample", ONE_TO_ALL, [])
    rollout_stats = elsewhere("rollout_stats", ONE_TO_ALL, {"engine": {}, "agent": {}, "sandbox": {}})
    close = elsewhere("close", ONE_TO_ALL)

    @register(dispatch=ONE_TO_ALL)
    def memory_report(self) -> dict:
        import psutil

        from hybridrl.backends.megatron.offload import held_bytes

        return {"mode": self.modes.mode.value, "role": "train", **held_bytes(self.actor), **self._critic_memory(),
                "staging_bytes": self.staging.nbytes, "rss_bytes": psutil.Process().memory_info().rss,
                "phases": self.modes.summary()}


class RolloutWorker(HybridWorker):
    """A rollout rank of the disaggregated placement (see the module doc)."""

    def __init__(self, cfg: Any, ctx: Any):
        from hybridrl.agent.producer import LoopThread

        self.threads = LoopThread()          # the engine's loop, running in its own thread
        super().__init__(cfg, ctx)
        self.modes.to(Mode.RESHARD)
        self.modes.to(Mode.ROLLOUT)          # a rollout rank always serves

    def switch_ranks(self) -> list[int]:
        return self.ctx.roles.rollout_ranks

    def meshes(self) -> dict[str, Mesh]:
        return _meshes(self.cfg, self.ctx)

    def _event_loop(self):
        return self.threads.loop

    def _run(self, coro):
        return self.threads.run(coro)

    def _build_training(self) -> None:
        self.actor = self.ref = self.critic = None
        self.spill_dir = None

    def _build_rollout(self) -> None:
        from hybridrl.agent.producer import Producer

        super()._build_rollout()                       # engine, tools, runner, reward model on this rank
        self._run(self.engine.wake_up(self.engine.releasable_tags))
        self.peers = _publish_group(self.ctx)
        self.peers.broadcast_object(self.engine.weight_spec() if self.ctx.rank == self.ctx.roles.num_train else None,
                                    self.ctx.roles.num_train)
        self.producer = Producer(self.runner, self.task, self.loop)

    def _build_engine(self):
        from hybridrl.backends.native import NativeEngine

        return NativeEngine.from_pretrained(self.cfg.model.path, self.cfg.rollout.native, device=self.ctx.device)

    def _build_transport(self):
        return None

    # ------------------------------------------------------------------ publication

    @register(dispatch=OneToAll("rank0"))
    def enter_rollout(self, *, version: int, step: int) -> dict:
        """Receive `version` from training rank 0 while the episodes go on (see the module doc)."""
        if not self._any_rank(self.engine.policy_version != version):
            return {}
        self.modes.switches += 1
        with self.modes.phase("publish", waits_for="the weights from training rank 0") as rec:
            got = receive_publication(self.peers, self.engine, self._run, src=0, device=self.ctx.device)
            rec.bytes_moved = got["bytes"]
        self.producer.poke()
        if got["error"] is not None:
            raise got["error"]
        if self.engine.policy_version == version and self._probe:
            with self.modes.phase("probe", waits_for="the parity probe"):
                outputs = None
                if self.ctx.rank == self.ctx.roles.num_train:
                    outputs = self._run(parity.engine_outputs(self.engine, self._probe, self.cfg.publish.parity_tokens,
                                                              tag=f"v{version}"))
                self.peers.broadcast_object(outputs, self.ctx.roles.num_train)
        return {}

    @register(dispatch=OneToAll("rank0"))
    def enter_train(self) -> dict:
        return {}

    # ------------------------------------------------------------------ generation

    @register(dispatch=DPSplit("rollout", pad_outputs=ROLLOUT_PADS))
    def rollout(self, episodes: Batch | None = None, *, temperature: float | None = None) -> Batch | None:
        """Episodes run beside the producer's (validation), on the same engine."""
        return None if episodes is None else self._episodes(episodes, temperature)

    def _mine(self, groups: list) -> list:
        """Whole groups dealt to the rollout ranks in turn: group i to rollout rank i % R."""
        mesh = self.meshes()["rollout"]
        return [g for i, g in enumerate(groups) if i % mesh.dp_size == mesh.dp_rank(self.ctx.rank)]

    @register(dispatch=ONE_TO_ALL)
    def grant(self, *, groups: list[list[dict]], floor: int) -> None:
        """Groups (each: its episodes' instance, attempt, group_id) to run once the engine serves a
        version >= `floor`."""
        from hybridrl.data.episode import TaskInstance

        mine = [[(TaskInstance.from_dict(e["instance"]), int(e["attempt"]), e["group_id"]) for e in group]
                for group in self._mine(groups)]
        self.producer.grant(mine, floor)

    @register(dispatch=ONE_TO_ALL)
    def take(self, *, group_ids: list[str], floor: int) -> dict:
        """This rank's complete groups among `group_ids` (waiting until they are), scored by the
        reward model when there is one; `floor` lowers what waiting groups need (a step without an
        update leaves the version where it was)."""
        self.producer.lower_floor(floor)
        with self.modes.phase("take"):
            trajectories = self.producer.take(self._mine(group_ids), aborted=self.ctx.control.aborted)
        self._score_with_reward_model(trajectories)
        return {"trajectories": trajectories, "stats": self.producer.stats()}

    @register(dispatch=ONE_TO_ALL)
    def sample(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0) -> list[dict]:
        return super().sample(prompts, max_new_tokens=max_new_tokens, temperature=temperature)

    @register(dispatch=ONE_TO_ALL)
    def rollout_stats(self) -> dict:
        pool = getattr(self.tools, "pool", None)
        return {"engine": self.threads.call(self.engine.stats), "agent": self.threads.call(dict, self.runner.counts),
                "sandbox": {"isolation": pool.mode if pool is not None else None},
                "producer": self.producer.stats()}

    @register(dispatch=ONE_TO_ALL)
    def memory_report(self) -> dict:
        import psutil

        return {"mode": self.modes.mode.value, "role": "rollout", **self._reward_model_memory(),
                "kv_cache_bytes": int(self.threads.call(self.engine.stats).get("kv_cache_bytes", 0)),
                "rss_bytes": psutil.Process().memory_info().rss, "phases": self.modes.summary()}

    # ------------------------------------------------------------------ what only training ranks do
    # (a rollout rank holds no training state: the controller records what it has in flight)

    compute_logprobs = elsewhere("compute_logprobs", DPSplit("train"))
    compute_ref_logprobs = elsewhere("compute_ref_logprobs", DPSplit("train"))
    train_step = elsewhere("train_step", DPSplit("train"))
    update_policy = elsewhere("update_policy", DPSplit("train"))
    update_lineage = elsewhere("update_lineage", ONE_TO_ALL)
    compute_values = elsewhere("compute_values", DPSplit("train"))
    train_critic = elsewhere("train_critic", DPSplit("train"))
    save_checkpoint = elsewhere("save_checkpoint", ONE_TO_ALL)
    load_checkpoint = elsewhere("load_checkpoint", OneToAll("rank0"), {})
    export_hf = elsewhere("export_hf", ONE_TO_ALL)

    @register(dispatch=ONE_TO_ALL)
    def close(self) -> None:
        self.threads.run(self._cancel_episodes())
        self._run(self.tools.close())
        self.threads.call(self.engine.close)
        self.threads.stop()

    async def _cancel_episodes(self) -> None:
        import asyncio

        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _reduce_device(ctx: Any) -> torch.device:
    return ctx.device if ctx.data_backend == "nccl" else torch.device("cpu")


def make_worker(cfg: Any, ctx: Any) -> HybridWorker:
    """The rl job's worker on this rank: the hybrid worker when colocated, else by the rank's role."""
    role = ctx.role
    if role == "train":
        return TrainerWorker(cfg, ctx)
    if role == "rollout":
        return RolloutWorker(cfg, ctx)
    return HybridWorker(cfg, ctx)
