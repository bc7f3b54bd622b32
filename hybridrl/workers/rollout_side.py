"""`RolloutSide`: what a rank that generates holds: a registered rollout engine (`rollout.registry`),
the agent runner with the task's tools and environments, and the reward scorers that run after the
agent loop (the task's verifier scores inside the loop; a reward model, when configured, here).

    rollout(episodes)     this rank's share of a step's episodes, run to their end (one row each)
    collect(...)          partial rollouts: launch groups, run until a quorum of complete groups over
                          all ranks, interrupt the rest at a token boundary, keep them for the next step
    sample(prompts)       raw generations (probes and tests)
    rollout_stats()       engine and agent counters

With a rollout tensor-parallel group of R ranks one engine serves the group, on its first rank; the
other ranks hold a `FollowerEngine` that takes part in the publication's collectives and runs no
episode. Coroutines of the engine run on `run` (the rank's event loop, or a loop in a thread of its
own when generation goes on while the rank answers the controller).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

import torch

from hybridrl.data.batch import Batch
from hybridrl.data.trajectory import TrajectoryStatus, to_batch
from hybridrl.distributed.collectives import Reducer
from hybridrl.distributed.dispatch import DPSplit, OneToAll
from hybridrl.distributed.mesh import Mesh
from hybridrl.rollout.registry import engine_row
from hybridrl.workers.base import Part, register
from hybridrl.workers.modes import Mode, Phases

log = logging.getLogger(__name__)

ON_ROLLOUT_RANKS = OneToAll(mesh="rollout")

# per-token tensors of a rollout: padded on the sequence dim when shards are put together
ROLLOUT_PADS = (("input_ids", 0), ("attention_mask", 0), ("loss_mask", 0.0), ("behavior_logprobs", 0.0),
                ("policy_version", -1), ("routed_experts", -1))       # (MoE: the routing record, -1 = none)

# what the reward model scores: every trajectory with a response the policy is answerable for
SCORED = (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED, TrajectoryStatus.FAILED)


class RolloutSide(Part):
    def __init__(self, cfg: Any, ctx: Any, phases: Phases, mesh: Mesh, *, threaded: bool = False,
                 follower_spec: Callable[[], dict] | None = None):
        """`threaded`: the engine, the agent loop and the tools live on an event loop running in a thread of
        its own (generation goes on while the rank's main thread answers the controller); else on a loop
        of the rank's main thread, run only inside calls (SGLang's tokenizer manager binds to its first loop)."""
        from transformers import AutoTokenizer

        from hybridrl.agent.producer import LoopThread
        from hybridrl.agent.tools.base import ToolBox
        from hybridrl.envs.tasks import get_task
        from hybridrl.agent.episodes import episode_runner

        self.cfg, self.ctx, self.phases, self.mesh = cfg, ctx, phases, mesh
        self.threads = LoopThread() if threaded else None
        self.loop = self.threads.loop if threaded else asyncio.new_event_loop()
        self.run: Callable[[Coroutine], Any] = self.threads.run if threaded else self.loop.run_until_complete
        self.group_ranks = mesh.group_along("tp", ctx.rank)          # this rank's rollout TP group
        self.owns_engine = ctx.rank == self.group_ranks[0]
        self.group = None                                           # gloo, over the TP group (tp > 1)
        if cfg.rollout.tp > 1:   # every rank creates every group, in the same order
            import torch.distributed as dist

            for ranks in mesh.groups_along("tp"):
                group = dist.new_group(ranks, backend="gloo")
                if ctx.rank in ranks:
                    self.group = group
        self.row = engine_row(cfg.rollout.engine)
        engine_cls = self.row.engine.resolve()
        self.engine = engine_cls.for_rank(cfg, ctx) if self.owns_engine else self._follower(follower_spec)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.reward_model = self._reward_model()
        self.task = get_task(cfg.task.name, cfg.task)
        tool_names = sorted({t for inst in self.task.validation_split(8) for t in inst.tools})
        self.tools = self.run(ToolBox.from_config(cfg.tools, names=tool_names).start())
        # the run's front end of the episode engine: the built-in agent loop, the gateway's runner (task.agent), ...
        self.runner = episode_runner(cfg, self.engine, self.tokenizer, tools=self.tools, envs=self._env_provider())
        self.collector = None              # partial rollouts: episodes kept across steps (built on first use)
        self.everyone = Reducer.over_peers(ctx.control_peers)
        self.probe_counts: dict[str, float] = {}    # engine counters spent on parity probes (not episodes)
        # what must end before counters are read: the disaggregated producer's running groups (their
        # progress at an arbitrary moment is timing), set by `StreamProducer`; it may instead give the
        # counters of a moment when nothing ran
        self.settle: Callable[[], dict | None] = lambda: None
        # what lets a call's episodes run alone on the engine (`rollout`), set by `StreamProducer`
        self.alone: Callable[[], None] = lambda: None

    # ------------------------------------------------------------------ construction

    def _follower(self, spec: Callable[[], dict] | None):
        """The stand-in on a rank of a rollout TP group that does not own its engine."""
        from hybridrl.rollout.follower import FollowerEngine

        if spec is None:
            raise ValueError(f"rank {self.ctx.rank}: rollout.tp={self.cfg.rollout.tp} needs the trainer's weight "
                             "spec on the group's other ranks (a colocated placement)")
        # it releases what the group's engine releases, so both forget the version together
        return FollowerEngine(spec(), releasable_tags=self.row.releasable_tags(self.cfg),
                              policy_version=0 if self.row.serves_before_publication else -1)

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

    def _reward_model(self):
        rm = self.cfg.reward_model
        if not rm.enabled or not self.owns_engine:
            return None
        from hybridrl.reward.model_scorer import RewardModelScorer

        return RewardModelScorer(rm.path, component=rm.component, device=self.ctx.device, batch_size=rm.batch_size,
                                 offload=rm.offload, policy_tokenizer_dir=self.cfg.model.path)

    # ------------------------------------------------------------------ generation

    @register(dispatch=DPSplit("rollout", pad_outputs=ROLLOUT_PADS))
    def rollout(self, episodes: Batch, *, temperature: float | None = None) -> Batch | None:
        """One row per episode (meta: instance, attempt, group_id) -> one row per trajectory."""
        from hybridrl.data.episode import TaskInstance

        self.phases.require(Mode.ROLLOUT)
        self.alone()                     # a validation beside the disaggregated groups: they end first
        if not self.owns_engine:
            return None                  # the group's first rank runs its episodes
        real = episodes.num_valid
        if real == 0:   # a shard of padding only (more rollout ranks than episodes)
            return _placeholder_rows(len(episodes))
        attempts = [(TaskInstance.from_dict(episodes["instance"][i]), int(episodes["attempt"][i]),
                     episodes["group_id"][i]) for i in range(real)]
        with self.phases.phase("generate"):
            trajectories = self.run(self.runner.run_attempts(attempts, task=self.task, temperature=temperature))
        self.stamp(trajectories)
        self.score(trajectories)
        return to_batch(trajectories, pad_id=self.tokenizer.pad_token_id or 0).pad_to(len(episodes))

    @register(dispatch=ON_ROLLOUT_RANKS)
    def collect(self, *, episodes: list[dict], quorum: int, deadline_s: float = 0.0, poll_s: float = 0.05,
                informative_only: bool = False, held: list | None = None) -> dict:
        """Partial rollouts: `episodes` (instance, attempt, group_id; the step's new ones, whole groups)
        are launched on the engines, group i on rollout dp rank i % dp; every held episode runs until
        `quorum` groups are complete over all ranks. Returns this rank's complete groups (scored by the
        reward model when there is one) and counters. `held`: the groups `hand_over` gave at a checkpoint
        (every rank's; each takes back its own)."""
        from hybridrl.agent.collector import PartialCollector
        from hybridrl.data.episode import TaskInstance

        self.phases.require(Mode.ROLLOUT)
        if self.collector is None:
            self.collector = PartialCollector(self.runner, self.task, self.loop, owns_engine=self.owns_engine,
                                              group_size=self.cfg.trainer.group_size, sum_over_ranks=self.everyone.sum,
                                              clock=self.row.step_clock(self.engine) if self.owns_engine else None)
        groups = list(dict.fromkeys(e["group_id"] for e in episodes))
        mine = {g for i, g in enumerate(groups) if i % self.mesh.dp_size == self.mesh.dp_rank(self.ctx.rank)}
        attempts = [(TaskInstance.from_dict(e["instance"]), int(e["attempt"]), e["group_id"])
                    for e in episodes if e["group_id"] in mine]
        with self.phases.phase("generate"):
            mine_held = [g for g in held or () if g.rank == self.mesh.dp_rank(self.ctx.rank)]
            trajectories, stats = self.collector.collect(attempts, quorum=quorum, deadline_s=deadline_s,
                                                         poll_s=poll_s, informative_only=informative_only,
                                                         held=mine_held)
        self.stamp(trajectories)
        self.score(trajectories)
        return {"trajectories": trajectories if self.owns_engine else [], "stats": stats.to_dict()}

    @register(dispatch=ON_ROLLOUT_RANKS)
    def hand_over(self) -> list:
        """At a checkpoint: every group this rank's partial collection holds, as data (`agent/saved.py`:
        episodes paused mid-turn saved whole), its tasks cancelled; `collect(held=...)` takes them back."""
        if self.collector is None:
            return []
        held = self.collector.hand_over(poll_s=self.cfg.trainer.collect_poll_s)
        for group in held:
            group.rank = self.mesh.dp_rank(self.ctx.rank)
        return held

    @register(dispatch=ON_ROLLOUT_RANKS)
    def sample(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0) -> list[dict]:
        """Raw generations of this rank's engine (token ids, logprobs, version): for probes and tests."""
        from hybridrl.rollout.protocol import SamplingParams

        self.phases.require(Mode.ROLLOUT)
        if not self.owns_engine:
            return []
        sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=0)

        async def go():
            return await asyncio.gather(*[self.engine.generate(p, sampling, f"sample-{self.ctx.rank}-{i}-{id(p)}")
                                          for i, p in enumerate(prompts)])

        return [{"token_ids": o.token_ids, "logprobs": o.logprobs, "policy_version": o.policy_version,
                 "finish_reason": o.finish_reason.value} for o in self.run(go())]

    def probe(self, prompts: list[list[int]], max_new_tokens: int, tag: str) -> list:
        """The parity probe's greedy generations on this rank's engine. What the engine spends on them is
        kept out of `rollout_stats`: a step's engine counters are its episodes' (a resumed run publishes,
        and probes, where the uninterrupted one did not)."""
        from hybridrl.publication import parity

        before = self.run_sync(lambda: dict(self.engine.stats()))
        outputs = self.run(parity.engine_outputs(self.engine, prompts, max_new_tokens, tag=tag))
        after = self.run_sync(lambda: dict(self.engine.stats()))
        for key, value in after.items():
            if _counter(value) and key in before:
                self.probe_counts[key] = self.probe_counts.get(key, 0) + value - before[key]
        return outputs

    def stamp(self, trajectories) -> None:
        """Which engine ran each trajectory (the rank that owns it): its track on the run's timeline."""
        for traj in trajectories:
            traj.metadata["engine_rank"] = self.ctx.rank

    def score(self, trajectories) -> None:
        """The reward model's component on every trajectory it scores (total += weight * score), on the
        rank that ran them (phase `reward_model`: its weights come to the device only for this)."""
        if self.reward_model is None:
            return
        chosen = [t for t in trajectories if t.status in SCORED]
        if not chosen:
            return
        scorer, weight = self.reward_model, self.cfg.reward_model.weight
        with self.phases.phase("reward_model") as rec:
            rec.bytes_moved = scorer.to_device()
            try:
                scores = scorer.score_ids(scorer.token_rows([t.prompt_ids + t.response_ids for t in chosen],
                                                            self.tokenizer))
            finally:
                rec.bytes_moved += scorer.release()
        for traj, score in zip(chosen, scores):
            traj.rewards[scorer.component] = float(score)
            traj.reward_evaluators[scorer.component] = scorer.evaluator
            traj.reward += weight * float(score)

    # ------------------------------------------------------------------ counters and memory

    @register(dispatch=ON_ROLLOUT_RANKS)
    def rollout_stats(self) -> dict:
        """Engine and agent-loop counters of this rank (cumulative), read once nothing runs (`settle`)."""
        settled = self.settle()
        return settled if settled is not None else self.counters()

    def counters(self) -> dict:
        """Engine and agent-loop counters of this rank now (cumulative; parity probes left out)."""
        pool = self.tools.pool
        engine = self.run_sync(lambda: dict(self.engine.stats()))
        engine.update({k: engine[k] - v for k, v in self.probe_counts.items() if k in engine})
        return {"engine": engine,
                "agent": self.run_sync(lambda: dict(self.runner.counts)),
                "sandbox": {"isolation": pool.mode if pool is not None else None}}

    def run_sync(self, fn: Callable[[], Any]) -> Any:
        """fn() where the engine's loop runs (reads of state that loop mutates)."""
        async def go():
            return fn()
        return self.run(go())

    def memory(self) -> dict:
        out = {"kv_cache_bytes": int(self.run_sync(self.engine.stats).get("kv_cache_bytes", 0))}
        if self.reward_model is not None:
            out["reward_model_bytes_resident"] = self.reward_model.resident_bytes()
        return out

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        self.run(self.runner.close())              # e.g. the gateway's server and client
        self.run(self.tools.close())
        self.run_sync(self.engine.close)
        if self.threads is not None:
            self.threads.stop()


def _counter(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _placeholder_rows(n: int) -> Batch:
    tensors = {name: torch.full((n, 1), value, dtype=torch.float32 if isinstance(value, float) else torch.long)
               for name, value in ROLLOUT_PADS if name != "routed_experts"}   # (concat fills it in)
    tensors["prompt_len"] = torch.zeros(n, dtype=torch.long)
    tensors["reward"] = torch.zeros(n)
    return Batch(tensors, {k: [None] * n for k in ("trajectory_id", "group_id", "status", "record")}, num_padding=n)
