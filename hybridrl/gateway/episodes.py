"""Episodes as the gateway knows them: a key issued per episode, its budgets, its capture.

A key is a random token (`secrets.token_urlsafe`) that exists only in this process, from the episode's
start to its end: a request is tied to its episode by the key alone (`Authorization: Bearer KEY`, or the
`X-Episode-Key` header), a key that ended is unknown, and no request can name another episode. Budgets
are checked before a request is served; a request past one is refused (`BudgetExceeded`, a 400 with
`error.type == "budget_exceeded"` and `error.code` the budget's name) and the episode ends TRUNCATED
with that budget.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hybridrl.agent.episodes import Episode
from hybridrl.data.trajectory import ToolCallRecord, Truncation
from hybridrl.gateway.capture import EpisodeCapture


class GatewayError(Exception):
    """An error the agent sees as an OpenAI error object (`status`, `type`, `code`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class BudgetExceeded(GatewayError):
    def __init__(self, truncation: Truncation, message: str):
        super().__init__(400, message, type="budget_exceeded", code=truncation.value)
        self.truncation = truncation


@dataclass(kw_only=True)
class Budgets:
    max_turns: int
    max_new_tokens_per_turn: int
    max_response_tokens: int
    max_episode_s: float
    close_turn_at_limit: bool = False        # agent.on_turn_limit=close_turn
    max_model_len: int = 1 << 30


@dataclass(eq=False, kw_only=True)
class GatewayEpisode(Episode):
    """One episode's state on the gateway (the episode engine's record, plus what the gateway keeps). The
    HTTP side (the server's thread) and the engine side (`loop`, where the runner opened it) both touch it:
    `lock` orders a completion's commit against the close."""

    key: str
    capture: EpisodeCapture
    budgets: Budgets
    replica: Any = None
    turns: int = 0                   # requests served
    truncation: Truncation | None = None
    end_reason: str = ""
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    executions: list[dict] = field(default_factory=list)    # hybridrl tools the agent ran (call_tool), in order
    counts: dict[str, int] = field(default_factory=lambda: {"sampling_overridden": 0, "malformed_tool_calls": 0,
                                                            "disconnected": 0})
    sampler_contract: int = 0
    closed: bool = False
    aborted: bool = False            # the engine ended a request (not a budget): the episode is ABORTED
    infra_error: str = ""            # the gateway failed serving it: the episode is INFRA_INVALID
    outcome: Any = None              # what the agent returned
    loop: Any = None                 # the engine's event loop: generation is run there (service.on_loop)
    lock: Any = field(default_factory=threading.RLock)

    @property
    def episode_id(self) -> str:
        return self.traj.trajectory_id

    @property
    def group_id(self) -> str:
        return self.traj.group_id

    def live_policy_tokens(self) -> int:
        return self.capture.policy_tokens

    def truncate(self, truncation: Truncation, reason: str = "") -> None:
        with self.lock:                      # the first budget to end the episode names it, from either side
            if self.truncation is None:
                self.truncation, self.end_reason = truncation, reason or truncation.value

    def check_open(self) -> None:
        """Refuse a request once a budget has ended the episode (or the wall clock has run out)."""
        if self.truncation is None and time.monotonic() >= self.deadline_at():
            self.truncate(Truncation.WALL_CLOCK, "the episode's wall-clock budget ran out")
        if self.truncation is not None:
            raise BudgetExceeded(self.truncation, f"the episode has ended: {self.end_reason} "
                                                  f"(budget {self.truncation.value})")
        if self.turns >= self.budgets.max_turns:
            self.truncate(Truncation.MAX_TURNS, f"more than agent.max_turns={self.budgets.max_turns} requests")
            raise BudgetExceeded(Truncation.MAX_TURNS, f"the episode has used its {self.budgets.max_turns} turns "
                                                       "(agent.max_turns)")


class EpisodeKeys:
    """key -> episode, for the episodes running now."""

    def __init__(self) -> None:
        self._by_key: dict[str, GatewayEpisode] = {}
        self.issued = 0

    @staticmethod
    def new_key() -> str:
        return "hyb-" + secrets.token_urlsafe(24)

    def add(self, episode: GatewayEpisode) -> None:
        if episode.key in self._by_key:
            raise ValueError("an episode key was issued twice")
        self._by_key[episode.key] = episode
        self.issued += 1

    def remove(self, episode: GatewayEpisode) -> None:
        with episode.lock:                   # after a commit in progress; none starts after this
            episode.closed = True
            self._by_key.pop(episode.key, None)

    def find(self, headers: Any) -> GatewayEpisode:
        key = headers.get("x-episode-key")
        if not key:
            auth = headers.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        episode = self._by_key.get(key) if key else None
        if episode is None:
            raise GatewayError(401, "unknown or expired episode key: each episode's client carries its own key, "
                                    "valid while the episode runs", type="invalid_request_error",
                               code="invalid_api_key")
        return episode

    def __len__(self) -> int:
        return len(self._by_key)
