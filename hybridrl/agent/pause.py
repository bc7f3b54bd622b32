"""`PauseGate`: interrupts a set of episodes at a token boundary and lets them continue later.

Partial rollouts (Kimi k1.5, 2025; slime's partial rollout; AReaL, Fu et al., 2025) end a step's
collection before its slowest episodes finish. The episodes still running are not discarded:

- `close()` then `quiesce()`: every generate request of the gated episodes in flight is aborted;
  the engine returns the tokens it produced so far (each labelled with the policy version that
  produced it) and the agent loop appends them, then waits at the gate before its next request.
  An episode inside a tool call or an environment step stays there; it waits at the gate when
  it wants to generate again. Nothing of the episode is lost: token history, per-token versions
  and behaviour logprobs, the agent's state, its environment session (kept open) and budgets.
- `open()`: the episodes continue, on whatever policy the engine serves now (the next version).

The wall-clock budget (`agent.max_episode_s`) does not run while the gate is closed: an episode's
deadline moves by the time it spent paused (`deadline`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class PauseGate:
    def __init__(self, engine: Any):
        self.engine = engine
        self._open = asyncio.Event()
        self._open.set()
        self._closed_at: float | None = None
        self._paused_s = 0.0                  # total time closed, before the current closure
        self.in_flight: set[str] = set()      # request ids of gated episodes now in the engine
        self.interruptions = 0                # requests aborted by a close (cumulative)
        self.running: dict[str, Any] = {}     # trajectory id -> the Trajectory of a gated episode not ended

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def paused_s(self) -> float:
        """Total time this gate has been closed, the current closure included."""
        extra = time.monotonic() - self._closed_at if self._closed_at is not None else 0.0
        return self._paused_s + extra

    def deadline(self, base: float, paused_at_start: float) -> float:
        """An episode's wall-clock deadline moved by the pauses since it started."""
        return base + self.paused_s() - paused_at_start

    async def wait(self) -> None:
        await self._open.wait()

    def close(self) -> None:
        if self._open.is_set():
            self._open.clear()
            self._closed_at = time.monotonic()

    def open(self) -> None:
        if not self._open.is_set():
            assert self._closed_at is not None
            self._paused_s += time.monotonic() - self._closed_at
            self._closed_at = None
            self._open.set()

    async def quiesce(self, poll_s: float = 0.005) -> int:
        """Abort every gated request in flight and wait until none is (the gate must be closed);
        returns how many were aborted. Each aborted episode appends what it generated so far."""
        if self.is_open:
            raise RuntimeError("quiesce() needs a closed gate: close() first")
        aborted = 0
        while self.in_flight:
            for rid in list(self.in_flight):
                if await self.engine.abort(rid):
                    aborted += 1
            await asyncio.sleep(poll_s)
        self.interruptions += aborted
        return aborted
