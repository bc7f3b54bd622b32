"""The `critic` section: the value model PPO with GAE trains beside the actor (algo.advantage=gae)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.backends.megatron.config import LR_SCHEDULES
from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, knob


@dataclass(kw_only=True)
class CriticConfig:
    """The critic: the actor's architecture with a scalar value head, on the Megatron backend (same
    tp/pp/dtype/micro-batch as `train`), with its own optimizer and LR schedule. Built only when
    algo.advantage=gae."""

    path: str = knob("", "HF directory the critic starts from; empty = the actor's model.path. A causal LM "
                         "(value head starts at 0) or a 1-label sequence classifier (its `score` head is the "
                         "value head)")
    lr: float = knob(1e-5, "peak learning rate of the critic's optimizer")
    min_lr: float = knob(0.0, "final learning rate of the decay")
    lr_warmup_steps: int = knob(0, "linear LR warm-up (critic optimizer steps)")
    lr_decay_steps: int = knob(0, "critic optimizer step at which the decay reaches min_lr (unused if constant)")
    lr_schedule: str = knob("constant", f"after warm-up: one of {list(LR_SCHEDULES)}")
    weight_decay: float = knob(0.0, "decoupled weight decay")
    clip_grad: float = knob(1.0, "clip the critic's gradients to this global L2 norm (0 = no clipping)")
    value_clip: float = knob(0.2, "value-loss clipping: new values within +-value_clip of the values the "
                                  "advantages came from; 0 disables")
    warmup_steps: int = knob(0, "RL steps at the start where only the critic trains (the actor is not updated "
                                "and the policy version does not move)")
    offload: bool = knob(True, "release the critic's optimizer state and gradients while the engine generates "
                               "(as the actor's; on a CPU device spilled to a file when hybrid.spill_optimizer)")

    def __post_init__(self) -> None:
        check_positive("lr", self.lr)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ConfigValueError("min_lr", f"must be <= lr ({self.lr}), got {self.min_lr}")
        for name in ("lr_warmup_steps", "lr_decay_steps", "warmup_steps"):
            check_positive(name, getattr(self, name), allow_zero=True)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.lr_schedule != "constant" and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigValueError("lr_decay_steps", f"must exceed lr_warmup_steps ({self.lr_warmup_steps}) with "
                                   f"lr_schedule={self.lr_schedule!r}, got {self.lr_decay_steps}")
        for name in ("weight_decay", "clip_grad", "value_clip"):
            check_positive(name, getattr(self, name), allow_zero=True)

    def megatron(self, train):
        """The critic's MegatronConfig: the actor's layout and precision, this section's optimizer."""
        import dataclasses

        return dataclasses.replace(train, lr=self.lr, min_lr=self.min_lr, lr_warmup_steps=self.lr_warmup_steps,
                                   lr_decay_steps=self.lr_decay_steps, lr_schedule=self.lr_schedule,
                                   weight_decay=self.weight_decay, clip_grad=self.clip_grad)
