"""One episode engine: what every door an episode comes through shares, written once.

A *front end* is a subclass of `EpisodeEngine` that implements `drive` (and, when it needs them,
`start`, `release`, `outcome`): the built-in agent loop (`agent/loop.py`) parses actions from the
policy's tokens; the OpenAI-compatible gateway (`gateway/runner.py`) serves the requests of an agent
the user wrote. Front ends are entries of `envs/front_ends.py: FRONT_ENDS` (imported when used);
`episode_runner` picks one from the config. What they share is here:

    run / run_attempts   `group_size` checked; one episode per (instance, attempt, group id), returned
                         in the order given (task-major: every attempt of a task, then the next)
    admission            at most `agent.max_concurrent_episodes` at once (a `Slot`, given back while
                         the episode waits at a closed `PauseGate`); admission blocks, never drops
    run_episode          `Task.for_instance` (a mixture's own task) and its `budgets`, the trajectory
                         and its deterministic id, the episode's seed, the kill switch; `drive`; the
                         status from how it ended; the environment session closed; the reward;
                         timings; the trajectory validated
    generate_turn        one assistant turn (`agent/turns.py: TurnCore`, a base of the engine): requests
                         until the turn ends, each segment with its version, logprobs, routing record
                         and seed, the wall clock and a stop request raced against it
    score                the task's verifier on the outcome, or the agent's own reward

How an episode ends: `drive` raises `EpisodeEnd(status, truncation, reason)`. An `AgentError` (the
user's agent code raised, or never asked the model anything) is the agent's failure: scored like a
failed episode (`agent.on_agent_error=score`, the default) or dropped from training
(`=drop`), counted as `agent_errors` either way and never called an infrastructure fault. Any other
exception is one (INFRA_INVALID, never trained on). The first agent error's traceback is logged once
per runner; later ones are counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from hybridrl.agent.config import AgentConfig
from hybridrl.agent.env_sessions import EnvProvider, EnvSession, LocalEnvProvider
from hybridrl.agent.pause import PauseGate, Slot
from hybridrl.agent.turns import EngineMeter, TurnCore, TurnProgress, race
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.data.trace import close_turn, trace
from hybridrl.data.trajectory import Trajectory, TrajectoryStatus, Truncation
from hybridrl.envs.front_ends import FRONT_ENDS, front_end_name
from hybridrl.envs.tasks.base import Task

log = logging.getLogger(__name__)


class EpisodeEnd(Exception):
    """Ends an episode with a status (raised from anywhere inside `drive`)."""

    def __init__(self, status: TrajectoryStatus, truncation: Truncation | None = None, reason: str = ""):
        super().__init__(reason or status.value)
        self.status, self.truncation, self.reason = status, truncation, reason


class AgentError(Exception):
    """The user's agent code failed (it raised, or made no request): the agent's fault, not the
    infrastructure's. `error` is the agent's own exception, when there is one."""

    def __init__(self, reason: str, error: BaseException | None = None):
        super().__init__(reason)
        self.reason, self.error = reason, error


# ---------------------------------------------------------------------------------------------------------
# seeds: one formula for every door


def episode_seed(run_seed: int, trajectory_id: str) -> int:
    """The episode's seed: a hash of the run's seed and the trajectory's deterministic id."""
    return int.from_bytes(hashlib.sha256(f"{run_seed}/{trajectory_id}".encode()).digest()[:4], "little")


# ---------------------------------------------------------------------------------------------------------
# records


@dataclass(eq=False, kw_only=True)
class Episode:
    """One running episode, as every front end keeps it (a front end may subclass it)."""

    instance: TaskInstance
    task: Task                              # the task that made the instance (a mixture's entry)
    traj: Trajectory
    cfg: AgentConfig                        # the runner's, with the task's own budgets
    seed: int
    temperature: float
    started: float = field(default_factory=time.monotonic)
    stop: asyncio.Event | None = None
    pause: PauseGate | None = None
    paused_at_start: float = 0.0
    slot: Slot | None = None
    session: EnvSession | None = None
    in_flight: set[str] = field(default_factory=set)
    # each request chain of the turn in progress (segments not yet appended to the trajectory)
    turns_open: list["TurnProgress"] = field(default_factory=list)
    resume_turn: "TurnProgress | None" = None     # a saved episode's turn, continued by the next generate_turn
    open_turn: tuple | None = None          # (turn, timings, first response index) of the turn being traced
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0, "env_s": 0.0})
    # what the verifier is handed at the end
    answer: str | None = None
    num_answers: int = 0
    final_text: str = ""
    env_return: float = 0.0
    messages: list[dict[str, str]] = field(default_factory=list)   # the episode's chat, as the model saw it
    own_reward: float | None = None         # an agent's own reward (the verifier is then not asked)
    stopper: asyncio.Future | None = field(default=None, repr=False)   # see stop_waiter

    @property
    def top_p(self) -> float:
        return self.cfg.top_p

    @property
    def top_k(self) -> int:
        return self.cfg.top_k

    def stop_waiter(self) -> asyncio.Future | None:
        """One wait on the run's stop for the whole episode, raced by each of its requests and tool calls (a
        wait of their own would be a task made and cancelled a request); cancelled when the episode ends."""
        if self.stop is not None and self.stopper is None:
            self.stopper = asyncio.ensure_future(self.stop.wait())
        return self.stopper

    def deadline_at(self) -> float:
        """The wall-clock deadline, moved by the time spent paused behind a gate."""
        deadline = self.started + self.cfg.max_episode_s
        return deadline if self.pause is None else self.pause.deadline(deadline, self.paused_at_start)

    def live_policy_tokens(self) -> int:
        """Policy tokens generated so far (what a collection's progress reads of a running episode), the
        segments of the turn in progress included (an episode interrupted mid-turn holds them there)."""
        return self.traj.num_policy_tokens + sum(p.produced for p in self.turns_open)


class EpisodeRunner(Protocol):
    """What the rollout side, collection and evaluation call (every front end is one)."""

    async def run(self, tasks: Sequence[TaskInstance], *, task: Task | dict[str, Task], group_size: int = 1,
                  step: int = 0, stop: asyncio.Event | None = None,
                  temperature: float | None = None) -> list[Trajectory]: ...

    async def run_attempts(self, attempts: Sequence[tuple[TaskInstance, int, str]], *,
                           task: Task | dict[str, Task], stop: asyncio.Event | None = None,
                           temperature: float | None = None, pause: PauseGate | None = None) -> list[Trajectory]: ...

    async def admit(self, inst: TaskInstance, task: Task, attempt: int, group_id: str,
                    stop: asyncio.Event | None, temperature: float | None,
                    pause: PauseGate | None = None, saved: Any = None) -> Trajectory:
        """One episode once a slot of `agent.max_concurrent_episodes` is free (what `run_attempts` does for
        each attempt; collectors that launch episodes one at a time call it). `saved`: continue it."""

    def stats(self, wall_s: float | None = None) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------------------------
# the engine


class EpisodeEngine(TurnCore):
    """Runs episodes against one engine (`engine`); subclasses are the front ends (see the module doc).
    Keep one per rollout phase (it accumulates stats)."""

    COUNTERS: tuple[str, ...] = ("episodes", "agent_errors", "tool_calls", "tool_errors", "malformed_actions")
    # whether `drive` continues an episode saved mid-turn (`agent/saved.py`); else a checkpoint holds the
    # episode's prompt and it runs again from there
    SAVES_EPISODES = False

    def __init__(self, engine: Any, *, agent_cfg: AgentConfig, tools: Any, run_id: str,
                 envs: EnvProvider | None = None, seed: int = 0):
        self.engine = engine
        self.cfg = agent_cfg
        self.tools = tools
        self.run_id = run_id
        self.seed = seed
        self.envs = envs or LocalEnvProvider()
        self.meter = EngineMeter()
        self.max_model_len = int(engine.max_model_len or 1 << 30)
        self.counts: dict[str, int] = dict.fromkeys(self.COUNTERS, 0)
        self._agent_error_shown = False
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ to implement

    @classmethod
    def from_config(cls, cfg: Any, engine: Any, tokenizer: Any, *, tools: Any, envs: Any = None) -> "EpisodeEngine":
        """This front end for a run (`episode_runner` calls it)."""
        raise NotImplementedError

    async def drive(self, ep: Episode) -> None:
        """Run the episode's turns; end it by raising `EpisodeEnd` (or `AgentError`)."""
        raise NotImplementedError

    async def start(self) -> None:
        """Before the first episode on the running loop (the gateway starts its server)."""

    async def close(self) -> None:
        """When the runner is done (the gateway stops its server)."""

    def open(self, ep: Episode) -> Episode:
        """The front end's own record of the episode (a subclass of `Episode`), or `ep` itself."""
        return ep

    async def release(self, ep: Episode) -> None:
        """After `drive`, whatever it ended with (the gateway retires the episode's key)."""

    def finish(self, ep: Episode) -> None:
        """Fill the trajectory from the front end's own record before it is scored (the gateway's capture)."""

    # ------------------------------------------------------------------ many episodes

    async def run(self, tasks: Sequence[TaskInstance], *, task: Task | dict[str, Task], group_size: int = 1,
                  step: int = 0, stop: asyncio.Event | None = None,
                  temperature: float | None = None) -> list[Trajectory]:
        """`group_size` episodes per instance; returns them in (instance, attempt) order."""
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
        attempts = [(inst, attempt, f"{inst.task_id}@{step}") for inst in tasks for attempt in range(group_size)]
        return await self.run_attempts(attempts, task=task, stop=stop, temperature=temperature)

    async def run_attempts(self, attempts: Sequence[tuple[TaskInstance, int, str]], *,
                           task: Task | dict[str, Task], stop: asyncio.Event | None = None,
                           temperature: float | None = None, pause: PauseGate | None = None) -> list[Trajectory]:
        """One episode per (instance, attempt, group_id), in the given order (what a data-parallel shard
        of a step's episodes holds). `temperature` overrides `agent.temperature` (validation is greedy)."""
        await self.start()
        coros = []
        for inst, attempt, group_id in attempts:
            source = task if isinstance(task, Task) else task[inst.task]
            coros.append(self.admit(inst, source, attempt, group_id, stop, temperature, pause))
        return list(await asyncio.gather(*coros))

    async def admit(self, inst: TaskInstance, task: Task, attempt: int, group_id: str,
                    stop: asyncio.Event | None, temperature: float | None,
                    pause: PauseGate | None = None, saved: Any = None) -> Trajectory:
        """See `EpisodeRunner.admit`."""
        queued = time.monotonic()
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:    # one limit per event loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.cfg.max_concurrent_episodes), loop
        slot = Slot(self._slots)
        await slot.take()
        try:
            return await self.run_episode(inst, task=task, attempt=attempt, group_id=group_id, stop=stop,
                                          queue_s=time.monotonic() - queued, temperature=temperature,
                                          pause=pause, slot=slot, saved=saved)
        finally:
            slot.give_back()

    # ------------------------------------------------------------------ one episode

    async def run_episode(self, instance: TaskInstance, *, task: Task, attempt: int = 0,
                          group_id: str | None = None, stop: asyncio.Event | None = None, queue_s: float = 0.0,
                          temperature: float | None = None, pause: PauseGate | None = None,
                          slot: Slot | None = None, saved: Any = None) -> Trajectory:
        """One episode; never raises for the episode's own problems (they become its status). `saved`: an
        episode saved mid-turn (`agent.saved.SavedEpisode`), continued where it stopped."""
        await self.start()
        ep = self.open(self._new_episode(instance, task, attempt, group_id, stop, temperature, pause, slot))
        if saved is not None:
            saved.restore(ep)
        else:
            self.counts["episodes"] += 1
        traj = ep.traj
        if pause is not None:
            pause.running[traj.trajectory_id] = ep
        try:
            await self._drive_checked(ep)
            raise AssertionError("drive() must end the episode with EpisodeEnd")   # pragma: no cover
        except EpisodeEnd as end:
            self._end(ep, end.status, end.truncation, end.reason)
        except AgentError as err:
            self._agent_failed(ep, err)
        except Exception as err:  # noqa: BLE001 - one broken episode must not kill the batch
            log.warning("episode %s failed: %s", traj.trajectory_id, err, exc_info=True)
            self._end(ep, TrajectoryStatus.INFRA_INVALID, None, f"{type(err).__name__}: {err}")
        finally:
            if ep.stopper is not None:
                ep.stopper.cancel()
            if pause is not None:
                pause.running.pop(traj.trajectory_id, None)
            close_turn(ep)
            await self._close(ep)
        self.finish(ep)
        self._nothing_to_score(ep)
        self.score(ep)
        traj.timings.update(ep.timings, queue_s=queue_s, total_s=time.monotonic() - ep.started)
        self._validate(traj)
        return traj

    def _new_episode(self, instance: TaskInstance, task: Task, attempt: int, group_id: str | None,
                     stop: asyncio.Event | None, temperature: float | None, pause: PauseGate | None,
                     slot: Slot | None) -> Episode:
        task = task.for_instance(instance)           # a mixture: the task that made the instance
        cfg = dataclasses.replace(self.cfg, **task.budgets) if task.budgets else self.cfg
        traj = Trajectory(run_id=self.run_id, task_id=instance.task_id, group_id=group_id or instance.task_id,
                          attempt=attempt, prompt_ids=[])
        return Episode(instance=instance, task=task, traj=traj, cfg=cfg,
                       seed=episode_seed(self.seed, traj.trajectory_id),
                       temperature=cfg.temperature if temperature is None else temperature, stop=stop,
                       pause=pause, paused_at_start=pause.paused_s() if pause is not None else 0.0, slot=slot)

    async def _drive_checked(self, ep: Episode) -> None:
        if ep.stop is not None and ep.stop.is_set():
            raise EpisodeEnd(TrajectoryStatus.ABORTED, reason="stopped before it started")
        if self.tools is not None and self.tools.killed is not None:     # the kill switch (agent/killswitch.py)
            raise EpisodeEnd(TrajectoryStatus.ABORTED, reason=f"kill switch: {self.tools.killed}")
        await self.drive(ep)

    async def _close(self, ep: Episode) -> None:
        try:
            await self.release(ep)
        finally:
            if ep.session is not None:
                try:
                    await ep.session.close()
                except Exception as err:  # noqa: BLE001
                    log.warning("closing the environment of %s failed: %s", ep.traj.trajectory_id, err)

    @staticmethod
    def _end(ep: Episode, status: TrajectoryStatus, truncation: Truncation | None, reason: str) -> None:
        ep.traj.status, ep.traj.truncation = status, truncation
        if reason:
            ep.traj.metadata["end_reason"] = reason

    def _agent_failed(self, ep: Episode, err: AgentError) -> None:
        """The agent's own failure: FAILED and scored, or dropped (ABORTED) with `on_agent_error=drop`;
        an agent that made no request has nothing to score and is always dropped."""
        self.counts["agent_errors"] += 1
        ep.traj.metadata["agent_error"] = err.reason
        if not self._agent_error_shown and err.error is not None:
            self._agent_error_shown = True
            shown = "".join(traceback.format_exception(type(err.error), err.error, err.error.__traceback__))
            log.error("the agent raised in episode %s (the first agent error of this runner; later ones are "
                      "counted as agent_errors):\n%s", ep.traj.trajectory_id, shown.rstrip())
        status = TrajectoryStatus.FAILED if self.cfg.on_agent_error == "score" else TrajectoryStatus.ABORTED
        self._end(ep, status, None, f"agent error: {err.reason}")

    @staticmethod
    def _nothing_to_score(ep: Episode) -> None:
        """An agent error before the policy generated anything leaves nothing to train: dropped."""
        traj = ep.traj
        if "agent_error" in traj.metadata and traj.status == TrajectoryStatus.FAILED and not traj.num_policy_tokens:
            traj.status = TrajectoryStatus.ABORTED

    @staticmethod
    def _validate(traj: Trajectory) -> None:
        try:
            traj.validate()
        except ValueError as err:            # a bug, not the policy's fault: keep it out of training
            log.error("episode %s produced an inconsistent trajectory: %s", traj.trajectory_id, err)
            traj.status, traj.truncation = TrajectoryStatus.INFRA_INVALID, None
            traj.metadata["end_reason"] = f"invalid trajectory: {err}"

    # ------------------------------------------------------------------ the reward

    def outcome(self, ep: Episode) -> EpisodeOutcome:
        """What the task's verifier is handed."""
        traj = ep.traj
        return EpisodeOutcome(answer=ep.answer, num_answers=ep.num_answers, final_text=ep.final_text,
                              completed=traj.status == TrajectoryStatus.COMPLETED, env_return=ep.env_return,
                              num_turns=traj.turns, num_tool_calls=len(traj.tool_calls),
                              messages=tuple(ep.messages))

    def score(self, ep: Episode) -> None:
        """The reward: the agent's own, or the task's verifier on the outcome. An evaluator error is not the
        policy's fault (INFRA_INVALID); an infrastructure-invalid or dropped episode gets 0."""
        traj = ep.traj
        started = time.monotonic()
        if traj.status == TrajectoryStatus.INFRA_INVALID or (traj.status == TrajectoryStatus.ABORTED
                                                               and "agent_error" in traj.metadata):
            traj.reward = 0.0
            return
        if ep.own_reward is not None:
            traj.rewards, traj.reward_evaluators, traj.reward = ({"agent": ep.own_reward},
                                                                 {"agent": self.own_reward_evaluator()}, ep.own_reward)
        else:
            try:
                result = ep.task.score(ep.instance, self.outcome(ep))
            except Exception as err:  # noqa: BLE001 - an evaluator error is not the policy's fault
                log.warning("scoring %s failed: %s", traj.trajectory_id, err, exc_info=True)
                self._end(ep, TrajectoryStatus.INFRA_INVALID, None, f"evaluator error: {type(err).__name__}: {err}")
                traj.reward = 0.0
                return
            traj.rewards, traj.reward_evaluators, traj.reward = result.rewards, result.evaluators, result.total
            traj.metadata["answer"] = ep.answer
        ep.timings["reward_s"] = time.monotonic() - started
        trace(traj, "reward", seconds=ep.timings["reward_s"], total=traj.reward, components=dict(traj.rewards),
              evaluators=dict(traj.reward_evaluators))

    def own_reward_evaluator(self) -> str:
        return "agent"

    # ------------------------------------------------------------------ stats

    def stats(self, wall_s: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {**self.counts, "engine_requests": self.meter.requests,
                               "engine_tokens": self.meter.tokens, "engine_busy_s": self.meter.busy()}
        if wall_s:
            out["engine_busy_fraction"] = self.meter.busy() / wall_s
        out["tools"] = self.tools.stats() if self.tools is not None else {}
        return out


async def within_budget(ep: Episode, awaitable: Any, timing: str) -> Any:
    """The result of `awaitable` (a tool batch, an env step), cancelled when the episode's wall-clock budget
    runs out (TRUNCATED) or a stop is requested (ABORTED); its time goes to ep.timings[timing]."""
    started = time.monotonic()
    fut = asyncio.ensure_future(awaitable)
    which = await race(fut, ep.deadline_at, ep.stop_waiter())
    ep.timings[timing] += time.monotonic() - started
    if which != "done":
        fut.cancel()
        if which == "deadline":
            raise EpisodeEnd(TrajectoryStatus.TRUNCATED, Truncation.WALL_CLOCK)
        raise EpisodeEnd(TrajectoryStatus.ABORTED, reason="stop requested")
    return fut.result()


# ---------------------------------------------------------------------------------------------------------
# front ends: envs/front_ends.py's registry, picked from the config


def episode_runner(cfg: Any, engine: Any, tokenizer: Any, *, tools: Any, envs: Any = None) -> EpisodeEngine:
    """The rollout side's runner for this run's front end (one per rollout phase or rank)."""
    front_end = FRONT_ENDS.get(front_end_name(cfg), key="task.front_end")
    return front_end.from_config(cfg, engine, tokenizer, tools=tools, envs=envs)
