"""What callers of the environment service (`hybridrl/envs/service.py`) catch and get back: its
refusals, the retryable errors (retry the same idempotency key: nothing executes twice), the lease
a reset issues and the reply of a step."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.data.episode import Transition


class EnvServiceError(Exception):
    """A request the service refuses; `str()` says why."""


class LeaseError(EnvServiceError):
    """Unknown episode, wrong token, or a lease that expired / was reclaimed / closed."""


class OutOfOrder(EnvServiceError):
    """`seq_no` is not the next one (a duplicate under a new key, a gap, or a replay)."""


class InvalidRequest(EnvServiceError, ValueError):
    """An argument of the wrong type or form (e.g. a `seq_no` that is not an int): nothing was done."""


class IdempotencyConflict(EnvServiceError):
    """A known idempotency key arrived with a different action or sequence number."""


class EpisodeKeyConflict(EnvServiceError):
    """A reset reused an episode key with a different task, instance or seed."""


class EpisodeDone(EnvServiceError):
    """The environment already ended this episode."""


class EnvStepError(EnvServiceError):
    """The environment raised while stepping (nothing was applied), or its step is recorded as failed."""


class StepInDoubt(EnvServiceError):
    """A step's owner process died between claiming and recording it: it may have executed, so it is
    never executed again (the episode fails) unless the environment is pure."""


class RetryableStepError(EnvServiceError):
    """Retry the same idempotency key later: nothing will execute twice."""


class DatabaseBusy(RetryableStepError):
    """The database stayed locked past the busy timeout before the step executed."""


class StepInProgress(RetryableStepError):
    """Another live service process holds this step's intent."""


class ResultNotWritten(RetryableStepError):
    """The step executed but its record could not be written yet; the retry of the same key writes it."""


@dataclass(frozen=True)
class Lease:
    episode_id: str
    token: str
    expires_at: float
    observation: str | None = None
    last_seq: int = 0


@dataclass(frozen=True)
class StepReply:
    seq_no: int
    transition: Transition
    replayed: bool                   # True: the recorded result of an earlier execution
