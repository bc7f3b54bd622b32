"""The environment protocol: a stateful world for one episode, stepped by the agent's actions.

Environments are synchronous, deterministic given (instance, seed, actions), and serialisable
(`state_dict` / `load_state_dict`) so the leased service can persist each transition and
restore an episode after a restart without re-executing anything.
"""

from __future__ import annotations

from typing import Any, Protocol

from hybridrl.data.episode import TaskInstance, Transition


class Environment(Protocol):
    # Optional class attribute `pure = True`: step() changes nothing outside the object's own state
    # (no files, no network, no processes), so the leased service may execute again a step whose
    # executor died mid-step, from the last committed state. Without it such a step is refused.

    def reset(self, instance: TaskInstance, seed: int) -> str | None:
        """Start the episode; returns an extra observation for the prompt, or None."""

    def step(self, action: dict[str, Any]) -> Transition:
        """`action`: {"text": the assistant turn, "answer": its <answer> or None}."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Scrub state before the object is dropped or reused."""
