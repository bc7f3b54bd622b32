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
deadline moves by the time it spent paused (`deadline`). While closed, a thread keeps the paused
episodes' environment sessions alive (`EnvSession.keep_alive`: a leased session renews its lease),
so a long update does not let the environment service reclaim them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


class PauseGate:
    def __init__(self, engine: Any):
        self.engine = engine
        self._open = asyncio.Event()
        self._open.set()
        self._closed_at: float | None = None
        self._paused_s = 0.0                  # total time closed, before the current closure
        self.in_flight: set[str] = set()      # request ids of gated episodes now in the engine
        self.interruptions = 0                # requests aborted by a close (cumulative)
        self.running: dict[str, Any] = {}     # trajectory id -> a gated episode not ended (agent.episodes.Episode)
        self.renewals = 0
        self._keeper: threading.Thread | None = None
        self._keeper_stop = threading.Event()

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

    async def wait(self, slot: "Slot | None" = None) -> None:
        """Wait until the gate is open. An episode waiting at a closed gate gives its concurrency `slot`
        back meanwhile, so that paused episodes never hold every slot while other episodes of the same
        runner must run (validation between the steps of a partial-rollout run); it takes one again
        before going on."""
        if slot is None or self.is_open:
            await self._open.wait()
            return
        slot.give_back()
        try:
            await self._open.wait()
        finally:
            await slot.take()

    def close(self) -> None:
        if self._open.is_set():
            self._open.clear()
            self._closed_at = time.monotonic()
            self._keeper_stop.clear()
            self._keeper = threading.Thread(target=self._keep_alive, name="pause-keep-alive", daemon=True)
            self._keeper.start()

    def open(self) -> None:
        if not self._open.is_set():
            assert self._closed_at is not None
            self._keeper_stop.set()
            if self._keeper is not None:
                self._keeper.join()
            self._paused_s += time.monotonic() - self._closed_at
            self._closed_at = None
            self._open.set()

    def stop(self) -> None:
        """Stop keeping sessions alive (the episodes are being cancelled)."""
        self._keeper_stop.set()
        if self._keeper is not None:
            self._keeper.join()

    def _keep_alive(self) -> None:
        """While closed: renew every paused episode's environment session as often as it asks."""
        wait = 1.0
        while True:
            asks = []
            for ep in list(self.running.values()):
                session = ep.session              # agent.episodes.Episode: None for tool-only tasks
                if session is None:
                    continue
                try:
                    every = session.keep_alive()
                    self.renewals += every is not None
                except Exception as err:  # noqa: BLE001 - the episode finds out at its next step
                    log.warning("keeping a paused episode's environment alive failed: %s", err)
                    every = None
                if every is not None:
                    asks.append(every)
            wait = min(asks, default=1.0)
            log.debug("keep-alive pass: %d paused episode(s), %d session(s) renewed, next in %.2f s",
                      len(self.running), len(asks), wait)
            if self._keeper_stop.wait(wait):
                return

    async def quiesce(self, poll_s: float = 0.005) -> int:
        """Abort every gated request in flight and wait until none is (the gate must be closed);
        returns how many were aborted. Each aborted episode appends what it generated so far."""
        if self.is_open:
            raise RuntimeError("quiesce() needs a closed gate: close() first")
        aborted = 0
        while self.in_flight:
            for rid in sorted(self.in_flight):      # a set's order follows the process's string hash seed
                if await self.engine.abort(rid):
                    aborted += 1
            await asyncio.sleep(poll_s)
        self.interruptions += aborted
        return aborted


class Slot:
    """One episode's hold on its runner's concurrency limit (`agent.max_concurrent_episodes`): taken at
    admission, given back at the end, and in between while the episode waits at a closed gate."""

    def __init__(self, limit: asyncio.Semaphore):
        self.limit, self.held = limit, False

    async def take(self) -> None:
        await self.limit.acquire()
        self.held = True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.limit.release()
