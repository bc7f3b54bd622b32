"""`TrainSide`: what a rank that trains holds: the actor, and as configured a frozen reference (a KL
term), a critic (GAE) and a frozen teacher (on-policy distillation, `algo/distill.py`), each a
training engine (`training.registry`), with the losses of the configured objective.

Its registered methods are the training side's work the controller asks for:

    update_policy          the whole training side of an RL step in one call (`workers/rl_step.py`)
    compute_logprobs       single pieces, for probes, benchmarks and tests: old / reference / teacher
    compute_ref_logprobs   logprobs at the rollout temperature, one optimizer step, the critic's values
    compute_teacher_logprobs  and one critic step
    train_step
    compute_values
    train_critic
    save_checkpoint / load_checkpoint / export_hf / memory_report

Between modes (colocated) the link between the sides calls `offload` / `reload`: optimizer state and
gradients of every trained model leave while the rollout engine generates and come back for training.
The frozen models (reference, teacher) hold neither: their weights stay where they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridrl.data.batch import Batch
from hybridrl.distributed.dispatch import DPSplit, OneToAll
from hybridrl.training import registry
from hybridrl.training.protocol import OPTIMIZER, TRAIN_MEMORY_TAGS
from hybridrl.workers.base import Part, register
from hybridrl.workers.modes import Mode, Phases
from hybridrl.workers.rl_step import Objective, update_policy

ON_TRAIN_RANKS = OneToAll(mesh="train")


class TrainSide(Part):
    def __init__(self, cfg: Any, ctx: Any, phases: Phases):
        from hybridrl.algo import distill
        from hybridrl.algo.objective import make_loss_fn

        self.cfg, self.ctx, self.phases = cfg, ctx, phases
        self.actor = registry.build(cfg, registry.ACTOR, ctx.device)
        self.ref = None
        if cfg.algo.uses_reference:     # with LoRA the reference is the actor's frozen base (no second copy)
            self.ref = (self.actor.base_model() if cfg.train.lora.enabled
                        else registry.build(cfg, registry.REFERENCE, ctx.device))
        self.critic = registry.build(cfg, registry.CRITIC, ctx.device) if cfg.algo.uses_critic else None
        self.teacher = registry.build(cfg, registry.TEACHER, ctx.device) if distill.enabled(cfg) else None
        value = None
        if self.critic is not None:
            from hybridrl.algo.value_loss import make_value_loss_fn

            value = make_value_loss_fn(cfg.critic.value_clip)
        self.objective = Objective(cfg.algo, make_loss_fn(cfg.algo), make_loss_fn(cfg.algo, old_from_forward=True), value,
                                   distill=cfg.distill if self.teacher is not None else None)
        self.spill_dir = Path(cfg.run.dir) / "offload" / f"rank{ctx.rank}" if cfg.hybrid.spill_optimizer else None

    @property
    def mesh(self):
        return self.actor.mesh

    @property
    def temperature(self) -> float:
        """Training logprobs use the rollout temperature, as the sampler contract defines them."""
        return self.cfg.agent.temperature if self.cfg.agent.temperature > 0 else 1.0

    # ------------------------------------------------------------------ the RL step

    @register(dispatch=DPSplit("train"))
    def update_policy(self, batch: Batch, *, mini_batch_rows: list[int], num_groups: int,
                      ppo_epochs: int | None = None, update_actor: bool = True) -> Batch | None:
        """The training side of one RL step on this rank's share of a laid-out batch (`workers/rl_step.py`).
        `ppo_epochs` defaults to algo.ppo_epochs; `update_actor=False` (the critic's warm-up) trains only the
        critic."""
        self.phases.require(Mode.TRAIN)
        epochs = self.cfg.algo.ppo_epochs if ppo_epochs is None else ppo_epochs
        with self.phases.phase("train"):
            return update_policy(self.actor, self.ref, self.critic, self.objective, batch,
                                 mini_batch_rows=mini_batch_rows, num_groups=num_groups, epochs=epochs,
                                 temperature=self.temperature, update_actor=update_actor, teacher=self.teacher)

    # ------------------------------------------------------------------ single pieces

    @register(dispatch=DPSplit("train"))
    def compute_logprobs(self, batch: Batch) -> Batch | None:
        """old_logprobs [B, T] of the current actor at the rollout temperature (token-aligned)."""
        self.phases.require(Mode.TRAIN)
        out = self.actor.compute_logprobs(batch, temperature=self.temperature)
        return None if out is None else Batch({"old_logprobs": out["logprobs"]})

    @register(dispatch=DPSplit("train"))
    def compute_ref_logprobs(self, batch: Batch) -> Batch | None:
        return self._scored(self.ref, "ref_logprobs", batch, "no reference model: algo.kl_coef is 0")

    @register(dispatch=DPSplit("train"))
    def compute_teacher_logprobs(self, batch: Batch) -> Batch | None:
        """teacher_logprobs [B, T] of the distillation teacher at the rollout temperature (token-aligned)."""
        return self._scored(self.teacher, "teacher_logprobs", batch, "no teacher model: distill.teacher is not set")

    def _scored(self, engine, name: str, batch: Batch, missing: str) -> Batch | None:
        """`name` [B, T]: a frozen model's logprobs of the batch at the rollout temperature (output ranks)."""
        self.phases.require(Mode.TRAIN)
        if engine is None:
            raise RuntimeError(missing)
        out = engine.compute_logprobs(batch, temperature=self.temperature)
        return None if out is None else Batch({name: out["logprobs"]})

    @register(dispatch=DPSplit("train"))
    def train_step(self, batch: Batch) -> dict:
        self.phases.require(Mode.TRAIN)
        with self.phases.phase("train"):
            return self.actor.train_step(batch, self.objective.policy, temperature=self.temperature, with_entropy=True)

    @register(dispatch=DPSplit("train"))
    def compute_values(self, batch: Batch) -> Batch | None:
        """values [B, T]: the critic's, token-aligned (0 off the sequence)."""
        self.phases.require(Mode.TRAIN)
        return self._require_critic().compute_values(batch)

    @register(dispatch=DPSplit("train"))
    def train_critic(self, batch: Batch) -> dict:
        """One step of the clipped value loss; the batch carries loss_mask, values (old) and returns."""
        self.phases.require(Mode.TRAIN)
        critic = self._require_critic()
        with self.phases.phase("critic_train"):
            return critic.train_step(batch, self.objective.value)

    def _require_critic(self):
        if self.critic is None:
            raise RuntimeError("no critic: it is built for algo.advantage=gae only")
        return self.critic

    # ------------------------------------------------------------------ memory (the link's mode switch)

    def trained(self) -> list[tuple[str, Any]]:
        """The models with optimizer state: (phase prefix, engine)."""
        out = [("", self.actor)]
        if self.critic is not None and self.cfg.critic.offload:
            out.append(("critic_", self.critic))
        return out

    def offload(self) -> None:
        """Optimizer state and gradients leave (phases `offload`, `critic_offload`). On a CPU device they
        leave only with `hybrid.spill_optimizer`: without it the optimizer state stays in the process, and
        the gradient buffers stay with it: freed, their 4 bytes a parameter would be faulted back in and
        zeroed page by page at every reload (the largest part of T_sync at 100M parameters and up,
        docs/benchmarks.md), while freeing them lowers the process's peak only where the KV cache the
        rollout allocates outweighs training's activations."""
        tags = TRAIN_MEMORY_TAGS if self.ctx.device.type != "cpu" or self.spill_dir is not None else (OPTIMIZER,)
        for prefix, engine in self.trained():
            spill = self.spill_dir if self.spill_dir is None or not prefix else self.spill_dir / "critic"
            with self.phases.phase(f"{prefix}offload") as rec:
                rec.bytes_moved = engine.offload(tags, spill_dir=spill)

    def reload(self, *, timed: bool = True) -> None:
        """They come back (phases `reload`, `critic_reload`; `timed=False` after a failed switch: no
        phase, so no barrier waits for ranks that may never come)."""
        for prefix, engine in self.trained():
            if not timed:
                engine.reload()
                continue
            with self.phases.phase(f"{prefix}reload") as rec:
                rec.bytes_moved = engine.reload()

    def memory(self) -> dict:
        """Optimizer state and gradient bytes this rank holds now, by accounting (the critic's apart)."""
        out = dict(self.actor.held_bytes())
        if self.critic is not None:
            out.update({f"critic_{k}": v for k, v in self.critic.held_bytes().items()})
        return out

    # ------------------------------------------------------------------ state

    @register(dispatch=ON_TRAIN_RANKS)
    def save_checkpoint(self, path: str, extra: dict) -> None:
        self.phases.require(Mode.TRAIN)
        self.actor.save_checkpoint(path, extra)
        if self.critic is not None:
            self.critic.save_checkpoint(critic_checkpoint_dir(path), extra)

    @register(dispatch=OneToAll("rank0", mesh="train"))
    def load_checkpoint(self, path: str) -> dict:
        self.phases.require(Mode.TRAIN)
        if self.critic is not None:
            where = critic_checkpoint_dir(path)
            if not (where / "metadata.json").exists():
                raise FileNotFoundError(f"{path}: the checkpoint holds no critic ({where} is missing); it was saved "
                                        "by a run without algo.advantage=gae")
            self.critic.load_checkpoint(where)
        return self.actor.load_checkpoint(path)

    @register(dispatch=OneToAll("rank0", mesh="train"))
    def scale_lr(self, factor: float) -> dict:
        """The actor's learning rate times `factor` from now on (an incident's rollback); before and after."""
        return self.actor.scale_lr(factor)

    @register(dispatch=ON_TRAIN_RANKS)
    def export_hf(self, out_dir: str) -> None:
        self.actor.export_hf(out_dir)

    @register(dispatch=ON_TRAIN_RANKS)
    def export_peft(self, out_dir: str) -> None:
        """A PEFT adapter directory of a LoRA actor (export_hf writes the merged weights)."""
        self.actor.export_peft(out_dir)


def critic_checkpoint_dir(model_path: str | Path) -> Path:
    """The critic's distributed checkpoint beside the actor's (`.../model` -> `.../critic`)."""
    return Path(model_path).parent / "critic"
