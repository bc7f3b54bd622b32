"""The `reward_model` section: a learned reward model as one more reward component. Import-light."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_positive, knob


@dataclass(kw_only=True)
class RewardModelConfig:
    """A reward model scoring finished trajectories on the rollout ranks, beside the task's verifier."""

    path: str = knob("", "HF directory of the reward model (a 1-label sequence classifier, or a causal LM with "
                         "value_head.safetensors); empty = no reward model")
    component: str = knob("reward_model", "the reward component's name in each trajectory's rewards")
    weight: float = knob(1.0, "weight of the score in the trajectory's total reward (total = verifier + "
                              "weight * score)")
    batch_size: int = knob(16, "trajectories per scoring forward pass")
    offload: bool = knob(True, "on a GPU, keep the reward model's weights in host memory except while it scores")

    def __post_init__(self) -> None:
        check_positive("batch_size", self.batch_size)
        if self.path and not self.component.strip():
            raise ConfigValueError("component", "needs a name for the reward component")

    @property
    def enabled(self) -> bool:
        return bool(self.path)
