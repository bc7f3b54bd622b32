"""The agent side of the leased environment service: sessions with sequence numbers,
deterministic idempotency keys, ambiguous-timeout handling and lease renewal.

A step that does not answer within `step_timeout_s` is ambiguous: it may have executed. The
session then asks `action_status` for its idempotency key; only if the service has no record
does it send the step again (same key, same sequence number), up to `max_retries` times. A step
the service answers with a retryable refusal (a locked database before or after executing,
another service process executing it) is sent again under the same key after a short backoff:
the service guarantees the key executes at most once. A reset refused for a locked database (before its
transaction, so nothing was written) is sent again the same way. A step in doubt (its executor died
mid-step) or recorded as failed raises: the episode is an infrastructure failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hybridrl.envs.config import EnvServiceConfig
from hybridrl.envs.service import DatabaseBusy, EnvService, EnvServiceError, Lease, RetryableStepError, StepReply
from hybridrl.data.episode import TaskInstance, Transition
from hybridrl.envs.tasks.base import Task

log = logging.getLogger(__name__)


class LeasedEnvSession:
    def __init__(self, service: EnvService, task: str, instance: TaskInstance, seed: int, episode_key: str,
                 cfg: EnvServiceConfig):
        self.service, self.task, self.instance, self.seed = service, task, instance, seed
        self.episode_key, self.cfg = episode_key, cfg
        self.lease: Lease | None = None
        self.seq = 0
        self.recorded = 0
        self.retries = 0
        self._renewed = 0.0

    @property
    def episode_id(self) -> str | None:
        return self.lease.episode_id if self.lease else None

    async def reset(self) -> str | None:
        for attempt in range(self.cfg.max_retries + 1):
            try:
                self.lease = await asyncio.to_thread(self.service.reset, self.task, self.instance, self.seed,
                                                     episode_key=self.episode_key)
                break
            except DatabaseBusy as err:           # refused before its transaction began: nothing was written
                if attempt == self.cfg.max_retries:
                    raise
                self.retries += 1
                log.warning("env reset %s (attempt %d): %s; retrying", self.episode_key, attempt + 1, err)
                await asyncio.sleep(min(0.05 * 2 ** attempt, 2.0))
        # The agent loop runs an episode from its first turn: after a crash it sends the same actions
        # under the same keys again (seq 1, 2, ...), answered from the record up to `recorded`.
        self.recorded = self.lease.last_seq
        self.seq = 0
        self._renewed = time.monotonic()
        return self.lease.observation

    async def step(self, action: dict[str, Any]) -> Transition:
        assert self.lease is not None, "reset() first"
        seq = self.seq + 1
        key = f"{self.episode_key}#{seq}"
        reply: StepReply | None = None
        for attempt in range(self.cfg.max_retries + 1):
            call = asyncio.to_thread(self.service.step, self.lease.episode_id, self.lease.token, action,
                                     seq_no=seq, idempotency_key=key)
            try:
                reply = await asyncio.wait_for(call, timeout=self.cfg.step_timeout_s)
                break
            except asyncio.TimeoutError:
                self.retries += 1
                log.warning("env step %s timed out (attempt %d): querying its status", key, attempt + 1)
                try:
                    reply = await asyncio.to_thread(self.service.action_status, self.lease.episode_id,
                                                    self.lease.token, key)
                except RetryableStepError as err:
                    log.warning("env step %s: %s", key, err)
                    reply = None
                if reply is not None:
                    break
            except RetryableStepError as err:         # nothing runs twice: the same key is answered or executed once
                self.retries += 1
                log.warning("env step %s (attempt %d): %s; retrying the same key", key, attempt + 1, err)
                await asyncio.sleep(min(0.05 * 2 ** attempt, 2.0))
        if reply is None:
            raise EnvServiceError(f"env step {key}: no answer after {self.cfg.max_retries + 1} attempts")
        self.seq = seq
        # a step renews; keep it explicit too
        if time.monotonic() - self._renewed > self.cfg.lease_ttl_s / 2:
            await asyncio.to_thread(self.service.renew, self.lease.episode_id, self.lease.token)
        self._renewed = time.monotonic()
        return reply.transition

    def keep_alive(self) -> float | None:
        """Renew the lease now (a paused partial-rollout episode: no step renews it); call again
        within the returned seconds."""
        if self.lease is not None:
            self.service.renew(self.lease.episode_id, self.lease.token)
            self._renewed = time.monotonic()
        return self.cfg.lease_ttl_s / 3

    async def close(self) -> None:
        if self.lease is not None:
            try:
                await asyncio.to_thread(self.service.close, self.lease.episode_id, self.lease.token)
            except EnvServiceError as err:          # already reclaimed / closed: nothing to release
                log.info("closing env episode %s: %s", self.lease.episode_id, err)


class LeasedEnvProvider:
    """Episodes of stateful tasks go through `service`; tool-only tasks get no session."""

    def __init__(self, service: EnvService, cfg: EnvServiceConfig | None = None):
        self.service = service
        self.cfg = cfg or EnvServiceConfig(db_path=str(service.db_path))

    def session(self, task: Task, instance: TaskInstance, *, seed: int,
                episode_key: str) -> LeasedEnvSession | None:
        if type(task).make_env is Task.make_env:
            return None
        return LeasedEnvSession(self.service, task.name, instance, seed, episode_key, self.cfg)
