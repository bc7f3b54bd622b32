"""`RewardResult`: reward components, the evaluator (name@version) behind each, and the total."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RewardResult:
    rewards: dict[str, float] = field(default_factory=dict)        # component -> value
    evaluators: dict[str, str] = field(default_factory=dict)       # component -> "name@version"
    total: float = 0.0

    def add(self, component: str, value: float, evaluator: str, *, weight: float = 1.0) -> "RewardResult":
        self.rewards[component] = float(value)
        self.evaluators[component] = evaluator
        self.total += weight * float(value)
        return self
