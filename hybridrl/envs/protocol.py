"""The environment protocol: a stateful world for one episode, stepped by the agent's actions.

Environments are synchronous, deterministic given (instance, seed, actions), and serialisable
(`state_dict` / `load_state_dict`) so the leased service can persist each transition and
restore an episode after a restart without re-executing anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridrl.envs.tasks.base import TaskInstance


@dataclass
class Transition:
    observation: str | None = None   # shown to the model (untrusted text) unless None
    reward: float = 0.0
    done: bool = False
    role: str = "user"               # chat role of the observation message
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"observation": self.observation, "reward": self.reward, "done": self.done, "role": self.role,
                "info": self.info}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Transition":
        return cls(d.get("observation"), float(d.get("reward", 0.0)), bool(d.get("done", False)),
                   d.get("role", "user"), dict(d.get("info", {})))


class Environment(Protocol):
    def reset(self, instance: TaskInstance, seed: int) -> str | None:
        """Start the episode; returns an extra observation for the prompt, or None."""

    def step(self, action: dict[str, Any]) -> Transition:
        """`action`: {"text": the assistant turn, "answer": its <answer> or None}."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Scrub state before the object is dropped or reused."""
