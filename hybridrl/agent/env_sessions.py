"""How an episode reaches its environment: in process, or through the leased service.

The agent loop asks an `EnvProvider` for a session per episode; tool-only tasks get None.
`LocalEnvProvider` steps the task's environment in process; `hybridrl.envs.client.
LeasedEnvProvider` goes through the leased service (sequence numbers, idempotency keys,
persisted transitions, lease renewal).
"""

from __future__ import annotations

from typing import Any, Protocol

from hybridrl.data.episode import TaskInstance, Transition
from hybridrl.envs.protocol import Environment
from hybridrl.envs.tasks.base import Task


class EnvSession(Protocol):
    async def reset(self) -> str | None:
        """Start the episode; an extra observation for the prompt, or None."""

    async def step(self, action: dict[str, Any]) -> Transition: ...

    async def close(self) -> None: ...

    def keep_alive(self) -> float | None:
        """Keep the session's resources while its episode is paused (from another thread); returns how
        often to call again in seconds (None: nothing expires)."""


class EnvProvider(Protocol):
    def session(self, task: Task, instance: TaskInstance, *, seed: int,
                episode_key: str) -> EnvSession | None: ...


class LocalEnvSession:
    def __init__(self, env: Environment, instance: TaskInstance, seed: int):
        self.env, self.instance, self.seed = env, instance, seed

    async def reset(self) -> str | None:
        return self.env.reset(self.instance, self.seed)

    async def step(self, action: dict[str, Any]) -> Transition:
        return self.env.step(action)

    async def close(self) -> None:
        self.env.close()

    def keep_alive(self) -> float | None:
        return None                   # in process: nothing expires


class LocalEnvProvider:
    """The task's environment, stepped in this process (cheap, pure environments)."""

    def session(self, task: Task, instance: TaskInstance, *, seed: int,
                episode_key: str) -> LocalEnvSession | None:
        env = task.make_env(instance)
        return None if env is None else LocalEnvSession(env, instance, seed)
