"""One assistant turn, as every front end of the episode engine (`agent/episodes.py`) generates it.

    TurnCore.generate_turn   requests to an engine until the turn ends: a request, then another for each
                             time new weights or a closed pause gate interrupt it (a new segment: its own
                             seed, version and routing record; a request the engine itself continued under
                             new weights is split into one segment per version), the episode's wall clock
                             and the run's stop raced against each request
    request_seed / request_id   one formula for every door: a segment of a turn (of a choice of `n`)
    race                     a wait cut by the episode's deadline (moved by pauses) or the run's stop
    TurnProgress / TurnOutput   a turn's segments so far (what a paused or saved episode holds) and the
                             finished turn
    EngineMeter              wall time with at least one request in flight (the engine's busy fraction)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from hybridrl.rollout.protocol import FinishReason, GenerationOutput, SamplingParams

if TYPE_CHECKING:
    from hybridrl.agent.episodes import Episode


def request_seed(episode: int, turn: int, segment: int, choice: int = 0) -> int:
    """The sampling seed of one engine request: a segment of a turn (of choice `choice` of `n`)."""
    return (episode + 7919 * turn + 104729 * segment + 15485863 * choice) % (1 << 31)


def request_id(trajectory_id: str, turn: int, segment: int, choice: int = 0) -> str:
    return f"{trajectory_id}/t{turn}" + (f".c{choice}" if choice else "") + (f".{segment}" if segment else "")


class EngineMeter:
    """Wall time during which at least one generate call is in flight (engine busy fraction)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.busy_s = 0.0
        self.requests = 0
        self.tokens = 0
        self._since = 0.0

    def begin(self) -> None:
        if self.in_flight == 0:
            self._since = time.monotonic()
        self.in_flight += 1
        self.requests += 1

    def end(self, tokens: int) -> None:
        self.in_flight -= 1
        self.tokens += tokens
        if self.in_flight == 0:
            self.busy_s += time.monotonic() - self._since

    def busy(self) -> float:
        return self.busy_s + (time.monotonic() - self._since if self.in_flight else 0.0)


@dataclass
class TurnProgress:
    """One request chain of a turn being generated: what an episode paused mid-turn holds, and what a
    saved episode (`agent/saved.py`) continues from."""

    turn: int
    choice: int = 0
    segments: list[GenerationOutput] = field(default_factory=list)
    requests: list[tuple[str, SamplingParams]] = field(default_factory=list)   # each segment's request
    segment: int = 0              # the next request's segment index (its seed and request id)
    parked: bool = False          # waiting at a closed pause gate before request `segment`

    @property
    def produced(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)


@dataclass
class TurnOutput:
    """One assistant turn as the engine produced it: its segments in order (a segment per request:
    each keeps its policy version, logprobs and routing record), and how it ended."""

    segments: list[GenerationOutput]
    requests: list[tuple[str, SamplingParams]]   # each segment's request id and sampling
    finish: FinishReason | None             # the last request's (None: cut before one came back)
    cut: str = ""                           # "" | "deadline" | "stop": the episode's clock or a stop cut it

    @property
    def ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [x for s in self.segments for x in s.logprobs]

    @property
    def versions(self) -> list[int]:
        return [s.policy_version for s in self.segments for _ in s.token_ids]


class TurnCore:
    """`generate_turn` for the episode engine, which it is a base of: it needs the engine's `meter` (an
    `EngineMeter`) and `cfg` (the agent config: `abort_grace_s`)."""

    meter: EngineMeter
    cfg: Any

    async def generate_turn(self, ep: Episode, engine: Any, context: list[int], room: int, *, turn: int,
                            choice: int = 0, stops: tuple[int, ...] = ()) -> TurnOutput:
        """Up to `room` new tokens after `context` from `engine`: one request, and another for each time new
        weights or a closed pause gate interrupt it (a new segment: its own seed, version and routing
        record). Ends when the engine says the turn ended, or the episode's wall clock or a stop cuts it (its
        partial output kept when the engine returns it in time)."""
        resumed = ep.resume_turn
        if resumed is not None and (resumed.turn, resumed.choice) == (turn, choice):   # a saved episode's turn
            ep.resume_turn, progress = None, resumed
        else:
            progress = TurnProgress(turn, choice)
        ep.turns_open.append(progress)                 # the turn's segments so far (read while it is paused)
        try:
            return await self._segments(ep, engine, context, room, stops, progress)
        finally:                                       # the caller appends them now
            ep.turns_open = [p for p in ep.turns_open if p is not progress]

    async def _segments(self, ep: Episode, engine: Any, context: list[int], room: int, stops: tuple[int, ...],
                        progress: TurnProgress) -> TurnOutput:
        """`generate_turn`'s requests from `progress.segment` on, each output kept in `progress` as it comes back."""
        turn, choice, segments, requests = progress.turn, progress.choice, progress.segments, progress.requests
        produced = progress.produced
        while True:
            segment = progress.segment
            if ep.pause is not None:
                progress.parked = not ep.pause.is_open
                await ep.pause.wait(ep.slot)           # interrupted: continue when the gate opens again
                progress.parked = False
            sampling = SamplingParams(max_new_tokens=room - produced, temperature=ep.temperature, top_p=ep.top_p,
                                      top_k=ep.top_k, seed=request_seed(ep.seed, turn, segment, choice),
                                      stop_token_ids=stops)
            rid = request_id(ep.traj.trajectory_id, turn, segment, choice)
            out, cut = await self._request(ep, engine, context + [t for s in segments for t in s.token_ids],
                                           sampling, rid)
            progress.segment += 1
            if out is not None and out.token_ids:
                for part in out.by_version():          # the engine applied new weights mid-request
                    segments.append(part)
                    requests.append((rid, sampling))
                produced += len(out.token_ids)
                if out.version_starts:
                    ep.traj.metadata["weight_updates_mid_turn"] = (ep.traj.metadata.get("weight_updates_mid_turn", 0)
                                                                   + len(out.version_starts))
            if cut or out is None:
                return TurnOutput(segments, requests, out.finish_reason if out is not None else None,
                                  cut or "deadline")
            if not self._continues(ep, out.finish_reason) or produced >= room:
                return TurnOutput(segments, requests, out.finish_reason)

    def _continues(self, ep: Episode, finish: FinishReason) -> bool:
        """Whether an interrupted request goes on in a new segment."""
        if finish == FinishReason.WEIGHTS_UPDATED and ep.cfg.on_weights_updated == "continue":
            ep.traj.metadata["weight_updates_mid_turn"] = ep.traj.metadata.get("weight_updates_mid_turn", 0) + 1
            return True
        if finish == FinishReason.ABORT and ep.pause is not None and not ep.pause.is_open:
            ep.traj.metadata["interruptions"] = ep.traj.metadata.get("interruptions", 0) + 1
            return True
        return False

    async def _request(self, ep: Episode, engine: Any, context: list[int], sampling: SamplingParams,
                       rid: str) -> tuple[GenerationOutput | None, str]:
        """(the engine's output, "") or, when the wall clock or a stop comes first, (the partial output the
        engine returns after an abort, or None; "deadline" | "stop")."""
        started = time.monotonic()
        self.meter.begin()
        produced = 0
        request = asyncio.ensure_future(engine.generate(context, sampling, rid))
        ep.in_flight.add(rid)
        if ep.pause is not None:
            ep.pause.in_flight.add(rid)
        try:
            which = await race(request, ep.deadline_at, ep.stop_waiter())
            if which == "done":
                out = request.result()
            else:
                out = await self._abort(engine, request, rid)
            produced = len(out.token_ids) if out is not None else 0
            return out, "" if which == "done" else which
        except asyncio.CancelledError:
            request.cancel()
            raise
        finally:
            ep.in_flight.discard(rid)
            if ep.pause is not None:
                ep.pause.in_flight.discard(rid)
            self.meter.end(produced)
            ep.timings["generate_s"] += time.monotonic() - started

    async def _abort(self, engine: Any, request: asyncio.Future, rid: str) -> GenerationOutput | None:
        """Abort an in-flight request; its partial output if the engine returns one in time."""
        try:
            await engine.abort(rid)
            return await asyncio.wait_for(request, timeout=self.cfg.abort_grace_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            request.cancel()
            return None
        except Exception:  # noqa: BLE001 - the engine failed while aborting: nothing to keep
            request.cancel()
            return None


async def race(fut: asyncio.Future, deadline: Callable[[], float], stopped: asyncio.Future | None) -> str:
    """Wait for `fut` until the deadline or `stopped` (a future done once a stop is requested, which the
    caller owns): "done" | "deadline" | "stop". The deadline is read again when the wait times out (a pause
    moves it)."""
    waiters = {fut} if stopped is None else {fut, stopped}
    while True:
        timeout = max(0.0, deadline() - time.monotonic())
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if done or time.monotonic() >= deadline():
            break
    if fut in done:
        fut.result()          # re-raise an engine / tool exception here
        return "done"
    return "stop" if stopped is not None and stopped in done else "deadline"
