"""Episodes that survive a checkpoint: one paused mid-turn behind a `PauseGate` is saved whole and
continues after a resume as a new segment, not from its prompt.

What a `SavedEpisode` holds is everything the episode's next request depends on:

    the trajectory so far      prompt, response tokens, loss mask, per-token behaviour logprobs and
                               policy versions, routing records, tool calls, turns, trace, metadata
    the turn in progress       its segments (each with its version, logprobs and request), the index
                               of the next segment (its seed and request id follow from it)
    the agent's state          the answer seen so far, the final text, the environment's return,
                               the open turn of the trace, the timings
    the remaining budget       the wall-clock time the episode has left (turns, tokens and context
                               are read from the trajectory)

The next request of a restored episode is the one the paused episode would have made: the same
context (prompt + response + the turn's segments), the same seed and the same request id, on
whatever version the engine serves then. So a run killed after a checkpoint and resumed makes the
same requests as one that went on, provided the uninterrupted run goes through the same door: the
collector hands its episodes over at every checkpoint and restores them at the next step
(`agent/collector.py`), in a resumed run and in an uninterrupted one alike.

Saved only when the front end declares it can continue one (`EpisodeEngine.SAVES_EPISODES`: the
built-in loop, whose state between requests is the trajectory) and the episode has no environment
session (a session's state lives in its own service); any other episode is held as its prompt and
runs again from there, as before.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from hybridrl.agent.episodes import Episode
from hybridrl.agent.turns import TurnProgress
from hybridrl.data.episode import TaskInstance
from hybridrl.data.trajectory import Trajectory


@dataclass
class SavedEpisode:
    instance: TaskInstance
    traj: Trajectory
    turn: TurnProgress               # the turn in progress (parked before request `turn.segment`)
    elapsed_s: float                 # wall-clock time the episode had run (its pauses not counted)
    answer: str | None = None
    num_answers: int = 0
    final_text: str = ""
    env_return: float = 0.0
    open_turn: tuple | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, ep: Episode) -> "SavedEpisode":
        """The state of `ep`, paused at a closed gate inside its one open turn (see `saveable`)."""
        (progress,) = ep.turns_open
        turn = TurnProgress(progress.turn, progress.choice, list(progress.segments), list(progress.requests),
                            progress.segment)
        elapsed = time.monotonic() - ep.started
        if ep.pause is not None:
            elapsed -= ep.pause.paused_s() - ep.paused_at_start
        # a copy: the episode's task is cancelled next, and its end writes to the trajectory it leaves
        return cls(instance=ep.instance, traj=copy.deepcopy(ep.traj), turn=turn, elapsed_s=max(0.0, elapsed), answer=ep.answer, num_answers=ep.num_answers,
                   final_text=ep.final_text, env_return=ep.env_return, open_turn=copy.deepcopy(ep.open_turn),
                   timings=dict(ep.timings))

    def restore(self, ep: Episode) -> None:
        """Make the new episode `ep` (same instance, attempt and group) this one: its next turn is the saved
        turn, continued from its next segment."""
        if ep.traj.trajectory_id != self.traj.trajectory_id:
            raise ValueError(f"restoring {self.traj.trajectory_id} into episode {ep.traj.trajectory_id}")
        ep.traj = self.traj
        ep.resume_turn = TurnProgress(self.turn.turn, self.turn.choice, list(self.turn.segments),
                                      list(self.turn.requests), self.turn.segment)
        ep.started = time.monotonic() - self.elapsed_s          # the wall-clock budget goes on from where it was
        ep.answer, ep.num_answers, ep.final_text = self.answer, self.num_answers, self.final_text
        ep.env_return, ep.open_turn, ep.timings = self.env_return, self.open_turn, dict(self.timings)
        ep.traj.metadata["restored"] = ep.traj.metadata.get("restored", 0) + 1     # saved at a checkpoint

    @property
    def policy_tokens(self) -> int:
        return self.traj.num_policy_tokens + self.turn.produced


@dataclass
class HeldGroup:
    """A group a collector held at a checkpoint, as data: its members that ended, its episodes saved
    mid-turn, and the attempts that run again from the prompt (those that could not be saved)."""

    group_id: str
    expected: int                                    # members launched
    ended: list[Trajectory] = field(default_factory=list)
    saved: list[SavedEpisode] = field(default_factory=list)
    again: list[tuple[TaskInstance, int]] = field(default_factory=list)     # (instance, attempt)
    rank: int = 0                                    # the rollout dp rank that held it

    def counts(self) -> dict[str, int]:
        return {"ended": len(self.ended), "saved": len(self.saved), "again": len(self.again),
                "saved_tokens": sum(s.policy_tokens for s in self.saved)}


def saveable(runner: Any, ep: Episode) -> bool:
    """Whether `ep` can be saved mid-turn: its front end continues saved episodes, it has no environment
    session, and it waits at a closed gate inside exactly one open turn."""
    return (type(runner).SAVES_EPISODES and ep.session is None and len(ep.turns_open) == 1
            and ep.turns_open[0].parked and ep.resume_turn is None)
