"""The async agent loop: many episodes share one engine; each is token-in-token-out.

One episode (`AgentRunner.run_episode`):

    prompt ids = chat template(messages) rendered once
    repeat:
        generate(context) -> ids, logprobs, version          appended with mask 1
        decode ids -> parse -> authorize -> tools (sandbox) / environment
        observation -> template delta ids                     appended with mask 0
    until an answer / env done (COMPLETED), no action (FAILED), a budget (TRUNCATED, with
    which), a stop request (ABORTED), or an infrastructure fault (INFRA_INVALID).

Budgets (the agent config's; a mixture's task may set its own, `Task.budgets`, and a mixture's
episode is run by the task that made its instance, `Task.for_instance`): `max_turns` assistant turns; `max_new_tokens_per_turn` (ends the episode, or with
`on_turn_limit=close_turn` closes the turn the way the template would, with mask 0, and goes
on); `max_response_tokens` for
everything after the prompt (an observation that would not fit ends the episode before it is
appended); `max_episode_s` of wall clock (the in-flight request is aborted and its partial
tokens are kept); the engine's context length. A turn interrupted by new weights continues
under the new version (`on_weights_updated=continue`): each token keeps the version that
produced it. Episodes run behind a `PauseGate` (partial rollouts) are interrupted the same way
when the gate closes and continue when it opens, usually on a newer version.

Many episodes (`AgentRunner.run` / `run_episodes`): one asyncio task per episode, admitted in
task-major order (all samples of a task, then the next) while fewer than
`max_concurrent_episodes` run. Backpressure policy: admission blocks, nothing is dropped or
resampled; every episode returns a `Trajectory`, in (task, attempt) order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hybridrl.agent.actions import ActionError, ActionParser, ToolAuthorizer, ToolCall
from hybridrl.agent.chat import ChatFormat
from hybridrl.agent.config import AgentConfig
from hybridrl.agent.env_sessions import EnvProvider, EnvSession, LocalEnvProvider
from hybridrl.agent.pause import PauseGate, Slot
from hybridrl.agent.tools.base import ToolBox
from hybridrl.data.trajectory import ToolCallRecord, Trajectory, TrajectoryStatus, Truncation
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task
from hybridrl.rollout.protocol import FinishReason, GenerationOutput, SamplingParams
from hybridrl.data.trace import close_turn, generate_event, trace

log = logging.getLogger(__name__)


class _End(Exception):
    """Ends an episode with a status (raised from deep inside a turn)."""

    def __init__(self, status: TrajectoryStatus, truncation: Truncation | None = None, reason: str = ""):
        super().__init__(reason or status.value)
        self.status, self.truncation, self.reason = status, truncation, reason


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
class _Episode:
    instance: TaskInstance
    task: Task
    traj: Trajectory
    deadline: float
    seed: int
    temperature: float
    cfg: AgentConfig                        # the runner's, with the task's own budgets (a mixture's entry)
    answer: str | None = None
    num_answers: int = 0
    final_text: str = ""
    env_return: float = 0.0
    session: EnvSession | None = None
    pause: PauseGate | None = None
    paused_at_start: float = 0.0
    slot: Slot | None = None
    open_turn: tuple | None = None          # (turn, timings, first response index) of the turn being traced
    timings: dict[str, float] = field(default_factory=lambda: {"generate_s": 0.0, "tool_s": 0.0,
                                                               "env_s": 0.0})

    def deadline_at(self) -> float:
        """The wall-clock deadline, moved by the time spent paused behind a gate."""
        if self.pause is None:
            return self.deadline
        return self.pause.deadline(self.deadline, self.paused_at_start)


class AgentRunner:
    """Runs episodes against one engine. Keep one per rollout phase (it accumulates stats)."""

    def __init__(self, engine: Any, tokenizer: Any, *, agent_cfg: AgentConfig, tools: ToolBox, run_id: str,
                 envs: EnvProvider | None = None, seed: int = 0):
        self.engine = engine
        self.cfg = agent_cfg
        self.tools = tools
        self.run_id = run_id
        self.seed = seed
        self.chat = ChatFormat(tokenizer, eos_token_ids=engine.eos_token_ids)
        self.envs = envs or LocalEnvProvider()
        self.meter = EngineMeter()
        self.max_model_len = int(engine.max_model_len or 1 << 30)
        self.counts: dict[str, int] = {"episodes": 0, "malformed_actions": 0, "unauthorized_actions": 0,
                                       "invalid_arguments": 0, "too_many_calls": 0, "tool_calls": 0,
                                       "tool_errors": 0}
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ many episodes

    async def run(self, tasks: Sequence[TaskInstance], *, task: Task | dict[str, Task], group_size: int = 1,
                  step: int = 0, stop: asyncio.Event | None = None,
                  temperature: float | None = None) -> list[Trajectory]:
        """`group_size` episodes per instance; returns them in (instance, attempt) order."""
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        attempts = [(inst, attempt, f"{inst.task_id}@{step}") for inst in tasks for attempt in range(group_size)]
        return await self.run_attempts(attempts, task=task, stop=stop, temperature=temperature)

    async def run_attempts(self, attempts: Sequence[tuple[TaskInstance, int, str]], *,
                           task: Task | dict[str, Task], stop: asyncio.Event | None = None,
                           temperature: float | None = None, pause: PauseGate | None = None) -> list[Trajectory]:
        """One episode per (instance, attempt, group_id), in the given order (what a data-parallel
        shard of a step's episodes holds); same concurrency limit and guarantees as `run`.
        `temperature` overrides `agent.temperature` for these episodes (validation samples greedily)."""
        coros = []
        for inst, attempt, group_id in attempts:
            source = task if isinstance(task, Task) else task[inst.task]
            coros.append(self._admit(inst, source, attempt, group_id, stop, temperature, pause))
        return list(await asyncio.gather(*coros))

    async def _admit(self, inst: TaskInstance, task: Task, attempt: int, group_id: str,
                     stop: asyncio.Event | None, temperature: float | None,
                     pause: PauseGate | None = None) -> Trajectory:
        queued = time.monotonic()
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:    # one limit per event loop
            self._slots, self._slots_loop = asyncio.Semaphore(self.cfg.max_concurrent_episodes), loop
        slot = Slot(self._slots)
        await slot.take()
        try:
            return await self.run_episode(inst, task=task, attempt=attempt, group_id=group_id, stop=stop,
                                          queue_s=time.monotonic() - queued, temperature=temperature,
                                          pause=pause, slot=slot)
        finally:
            slot.give_back()

    def parser(self, task: Task) -> ActionParser:
        """How this runner reads an assistant turn of `task`: the task's action formats (one parser
        per episode, so a subclass may return a stateful one)."""
        return ActionParser(task.action_formats)

    # ------------------------------------------------------------------ one episode

    async def run_episode(self, instance: TaskInstance, *, task: Task, attempt: int = 0,
                          group_id: str | None = None, stop: asyncio.Event | None = None, queue_s: float = 0.0,
                          temperature: float | None = None, pause: PauseGate | None = None,
                          slot: Slot | None = None) -> Trajectory:
        """One episode; never raises for the episode's own problems (they become its status).
        `temperature` overrides `agent.temperature` for this episode; with a `pause` gate the episode
        can be interrupted between (and within) requests and continued later (see `PauseGate`); while
        it waits at a closed gate it gives back its concurrency `slot` (when admitted with one)."""
        started = time.monotonic()
        task = task.for_instance(instance)          # a mixture: the task that made the instance
        cfg = dataclasses.replace(self.cfg, **task.budgets) if task.budgets else self.cfg
        traj = Trajectory(run_id=self.run_id, task_id=instance.task_id, group_id=group_id or instance.task_id,
                          attempt=attempt, prompt_ids=[])
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}/{traj.trajectory_id}".encode()).digest()[:4],
                              "little")
        ep = _Episode(instance, task, traj, started + cfg.max_episode_s, seed,
                      temperature=cfg.temperature if temperature is None else temperature, cfg=cfg,
                      pause=pause, paused_at_start=pause.paused_s() if pause is not None else 0.0, slot=slot)
        self.counts["episodes"] += 1
        if pause is not None:
            pause.running[traj.trajectory_id] = ep
        try:
            await self._episode(ep, stop)
            raise AssertionError("an episode must end with _End")   # pragma: no cover
        except _End as end:
            traj.status, traj.truncation = end.status, end.truncation
            if end.reason:
                traj.metadata["end_reason"] = end.reason
        except Exception as err:  # noqa: BLE001 - one broken episode must not kill the batch
            log.warning("episode %s failed: %s", traj.trajectory_id, err, exc_info=True)
            traj.status, traj.truncation = TrajectoryStatus.INFRA_INVALID, None
            traj.metadata["end_reason"] = f"{type(err).__name__}: {err}"
        finally:
            if pause is not None:
                pause.running.pop(traj.trajectory_id, None)
            close_turn(ep)
            if ep.session is not None:
                try:
                    await ep.session.close()
                except Exception as err:  # noqa: BLE001
                    log.warning("closing the environment of %s failed: %s", traj.trajectory_id, err)
        self._score(ep)
        traj.timings.update(ep.timings, queue_s=queue_s, total_s=time.monotonic() - started)
        try:
            traj.validate()
        except ValueError as err:            # a bug, not the policy's fault: keep it out of training
            log.error("episode %s produced an inconsistent trajectory: %s", traj.trajectory_id, err)
            traj.status, traj.truncation = TrajectoryStatus.INFRA_INVALID, None
            traj.metadata["end_reason"] = f"invalid trajectory: {err}"
        return traj

    async def _episode(self, ep: _Episode, stop: asyncio.Event | None) -> None:
        cfg, traj = ep.cfg, ep.traj
        if stop is not None and stop.is_set():
            raise _End(TrajectoryStatus.ABORTED, reason="stopped before it started")
        if getattr(self.tools, "killed", None) is not None:     # the kill switch (agent/killswitch.py)
            raise _End(TrajectoryStatus.ABORTED, reason=f"kill switch: {self.tools.killed}")
        authorizer = ToolAuthorizer(self.tools.specs, ep.instance.tools)
        tool_json = [authorizer.specs[n].to_json() for n in authorizer.allowed] if ep.task.render_tools else None
        messages = list(ep.instance.messages)
        ep.session = self.envs.session(ep.task, ep.instance, seed=ep.seed, episode_key=traj.trajectory_id)
        extra = await ep.session.reset() if ep.session is not None else None
        if extra:
            messages.append({"role": "user", "content": self.chat.sanitize(extra, cfg.max_observation_chars)})
        traj.prompt_ids = self.chat.prompt_ids(messages, tools=tool_json)
        parser = self.parser(ep.task)
        for turn in range(cfg.max_turns):
            close_turn(ep)
            ep.open_turn = (turn, dict(ep.timings), len(traj.response_ids))
            ids, finish = await self._turn(ep, turn, stop)
            traj.turns = turn + 1
            ep.final_text = text = self.chat.decode(ids)
            parsed = parser.parse(text)
            trace(traj, "parse", turn=turn, answer=parsed.answer is not None, num_answers=parsed.num_answers,
                  calls=len(parsed.calls), errors=len(parsed.errors))
            ep.answer, ep.num_answers = parsed.answer, parsed.num_answers
            ended_with_eos = bool(ids) and ids[-1] in self.chat.eos_ids
            if parsed.answer is not None or not parsed.has_action:
                if ep.session is None:
                    if parsed.answer is None:
                        raise _End(TrajectoryStatus.FAILED,
                                   reason="the turn has neither an action nor an answer")
                    raise _End(TrajectoryStatus.COMPLETED)
                obs_messages = await self._env_step(ep, text, parsed.answer, stop)
            else:
                if turn == cfg.max_turns - 1:
                    raise _End(TrajectoryStatus.TRUNCATED, Truncation.MAX_TURNS)
                obs_messages = await self._act(ep, turn, parsed.calls, parsed.errors, authorizer, stop)
            if turn == cfg.max_turns - 1:
                raise _End(TrajectoryStatus.TRUNCATED, Truncation.MAX_TURNS)
            self._append_observation(ep, obs_messages, ended_with_eos, finish)

    # ------------------------------------------------------------------ generation

    async def _turn(self, ep: _Episode, turn: int,
                    stop: asyncio.Event | None) -> tuple[list[int], FinishReason]:
        """One assistant turn (several requests if new weights interrupt it); appends its tokens."""
        cfg, traj = ep.cfg, ep.traj
        ids: list[int] = []
        segment = 0
        while True:
            used = len(traj.response_ids)
            context = len(traj.prompt_ids) + used
            bounds = {Truncation.MAX_RESPONSE_TOKENS: cfg.max_response_tokens - used,   # ties: the first wins
                      Truncation.CONTEXT: self.max_model_len - context,
                      Truncation.MAX_NEW_TOKENS: cfg.max_new_tokens_per_turn - len(ids)}
            limit, room = min(bounds.items(), key=lambda kv: kv[1])
            if room < 1:
                raise _End(TrajectoryStatus.TRUNCATED, limit)
            if ep.pause is not None:
                await ep.pause.wait(ep.slot)           # interrupted: continue when the gate opens again
            sampling = SamplingParams(max_new_tokens=room, temperature=ep.temperature, top_p=cfg.top_p,
                                      top_k=cfg.top_k, seed=(ep.seed + 7919 * turn + 104729 * segment) % (1 << 31))
            rid = f"{traj.trajectory_id}/t{turn}" + (f".{segment}" if segment else "")
            out = await self._generate(ep, traj.prompt_ids + traj.response_ids, sampling, rid, stop)
            generate_event(traj, turn, rid, sampling, out, start=len(traj.response_ids))
            if out.token_ids:
                traj.append(out.token_ids, policy=True, logprobs=out.logprobs, version=out.policy_version,
                            routed_experts=out.routed_experts)
            traj.sampler_contract = out.sampler_contract
            ids += out.token_ids
            finish = out.finish_reason
            if finish == FinishReason.WEIGHTS_UPDATED and cfg.on_weights_updated == "continue":
                segment += 1
                traj.metadata["weight_updates_mid_turn"] = traj.metadata.get("weight_updates_mid_turn", 0) + 1
                continue
            if finish == FinishReason.ABORT and ep.pause is not None and not ep.pause.is_open:
                segment += 1                           # the gate closed mid-request: keep what came back
                traj.metadata["interruptions"] = traj.metadata.get("interruptions", 0) + 1
                continue
            if finish == FinishReason.STOP:
                return ids, finish
            if finish == FinishReason.LENGTH:
                if limit == Truncation.MAX_NEW_TOKENS and cfg.on_turn_limit == "close_turn":
                    traj.metadata["turns_cut"] = traj.metadata.get("turns_cut", 0) + 1
                    return ids, finish
                raise _End(TrajectoryStatus.TRUNCATED, limit)
            if finish == FinishReason.CONTEXT:
                raise _End(TrajectoryStatus.TRUNCATED, Truncation.CONTEXT)
            raise _End(TrajectoryStatus.ABORTED, reason=f"the engine ended the request: {finish.value}")

    async def _generate(self, ep: _Episode, context: list[int], sampling: SamplingParams, rid: str,
                        stop: asyncio.Event | None) -> GenerationOutput:
        started = time.monotonic()
        self.meter.begin()
        produced = 0
        request = asyncio.ensure_future(self.engine.generate(context, sampling, rid))
        if ep.pause is not None:
            ep.pause.in_flight.add(rid)
        try:
            which = await _race(request, ep.deadline_at, stop)
            if which == "done":
                out = request.result()
                produced = len(out.token_ids)
                return out
            partial = await self._abort(request, rid)
            if partial is not None and partial.token_ids:
                generate_event(ep.traj, ep.open_turn[0] if ep.open_turn else -1, rid, sampling, partial,
                               start=len(ep.traj.response_ids))
                produced = len(partial.token_ids)
                ep.traj.append(partial.token_ids, policy=True, logprobs=partial.logprobs,
                               version=partial.policy_version, routed_experts=partial.routed_experts)
            if which == "deadline":
                raise _End(TrajectoryStatus.TRUNCATED, Truncation.WALL_CLOCK)
            raise _End(TrajectoryStatus.ABORTED, reason="stop requested")
        finally:
            if ep.pause is not None:
                ep.pause.in_flight.discard(rid)
            self.meter.end(produced)
            ep.timings["generate_s"] += time.monotonic() - started

    async def _abort(self, request: asyncio.Future, rid: str) -> GenerationOutput | None:
        """Abort an in-flight request; its partial output if the engine returns one in time."""
        try:
            await self.engine.abort(rid)
            return await asyncio.wait_for(request, timeout=self.cfg.abort_grace_s)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            request.cancel()
            return None
        except Exception:  # noqa: BLE001 - the engine failed while aborting: nothing to keep
            request.cancel()
            return None

    # ------------------------------------------------------------------ actions

    async def _act(self, ep: _Episode, turn: int, calls: Sequence[ToolCall], errors: Sequence[ActionError],
                   authorizer: ToolAuthorizer, stop: asyncio.Event | None) -> list[dict[str, str]]:
        """Authorize and run the turn's calls (concurrently); one observation message per call."""
        traj, cfg = ep.traj, ep.cfg
        plan: list[tuple[ToolCall | None, ActionError | None]] = [(None, e) for e in errors]
        for i, call in enumerate(calls):
            if i >= cfg.max_tool_calls_per_turn:
                plan.append((None, ActionError(f"at most {cfg.max_tool_calls_per_turn} tool calls per turn; "
                                               f"'{call.name}' was not run", call.raw, "too_many_calls", call.name)))
                continue
            problem = authorizer.check(call)
            plan.append((call, None) if problem is None else (None, problem))
        run = [self.tools.call(call, context={"episode": traj.trajectory_id, "call": f"t{turn}.{i}"})
               for i, (call, _) in enumerate(plan) if call is not None]
        results = iter(await _within_budget(ep, asyncio.gather(*run), stop, "tool_s"))
        messages = []
        for call, problem in plan:
            if problem is not None:
                trace(traj, "action", turn=turn, tool=problem.tool, decision=problem.kind, message=problem.message)
                self.counts[{"malformed": "malformed_actions", "unauthorized": "unauthorized_actions"}
                            .get(problem.kind, problem.kind)] += 1
                traj.metadata[f"num_{problem.kind}"] = traj.metadata.get(f"num_{problem.kind}", 0) + 1
                traj.tool_calls.append(ToolCallRecord(turn=turn, name=problem.tool, ok=False,
                                                      error=f"{problem.kind}: {problem.message}"))
                messages.append({"role": "tool", "content": f"error: {problem.message}"})
                continue
            result = next(results)
            self.counts["tool_calls"] += 1
            self.counts["tool_errors"] += not result.ok
            traj.tool_calls.append(ToolCallRecord(turn=turn, name=call.name, ok=result.ok, error=result.error,
                                                  latency_s=result.latency_s))
            trace(traj, "action", turn=turn, tool=call.name, decision="authorized", format=call.format,
                  ok=result.ok, error=result.error, infra_error=bool(result.infra_error), latency_s=result.latency_s)
            if result.infra_error:
                raise _End(TrajectoryStatus.INFRA_INVALID, reason=f"tool {call.name}: {result.error}")
            messages.append({"role": "tool", "content": result.text})
        return messages

    async def _env_step(self, ep: _Episode, text: str, answer: str | None,
                        stop: asyncio.Event | None) -> list[dict[str, str]]:
        assert ep.session is not None
        started = time.monotonic()
        transition = await _within_budget(ep, ep.session.step({"text": text, "answer": answer}), stop, "env_s")
        trace(ep.traj, "env_step", turn=ep.open_turn[0] if ep.open_turn else -1, reward=transition.reward,
              done=transition.done, seconds=time.monotonic() - started,
              info={k: v for k, v in transition.info.items() if isinstance(v, (int, float, str, bool))})
        ep.env_return += transition.reward
        ep.traj.metadata["env_steps"] = ep.traj.metadata.get("env_steps", 0) + 1
        if transition.done:
            raise _End(TrajectoryStatus.COMPLETED)
        return [{"role": transition.role, "content": transition.observation or ""}]

    def _append_observation(self, ep: _Episode, messages: list[dict[str, str]], after_eos: bool,
                            finish: FinishReason) -> None:
        traj = ep.traj
        clean = [{"role": m["role"], "content": self.chat.sanitize(m["content"],
                                                                   ep.cfg.max_observation_chars)}
                 for m in messages]
        ids = self.chat.observation_ids(clean, after_eos=after_eos)
        if len(traj.response_ids) + len(ids) > ep.cfg.max_response_tokens:
            raise _End(TrajectoryStatus.TRUNCATED, Truncation.MAX_RESPONSE_TOKENS,
                       reason="the next observation does not fit the response budget")
        if len(traj.prompt_ids) + len(traj.response_ids) + len(ids) >= self.max_model_len:
            raise _End(TrajectoryStatus.TRUNCATED, Truncation.CONTEXT,
                       reason="the next observation does not fit the context")
        trace(traj, "observation", turn=ep.open_turn[0] if ep.open_turn else -1, start=len(traj.response_ids),
              end=len(traj.response_ids) + len(ids), roles=[m["role"] for m in clean])
        traj.append(ids, policy=False)

    # ------------------------------------------------------------------ reward

    def _score(self, ep: _Episode) -> None:
        traj = ep.traj
        started = time.monotonic()
        if traj.status == TrajectoryStatus.INFRA_INVALID:
            traj.reward = 0.0
            return
        outcome = EpisodeOutcome(answer=ep.answer, num_answers=ep.num_answers, final_text=ep.final_text,
                                 completed=traj.status == TrajectoryStatus.COMPLETED, env_return=ep.env_return,
                                 num_turns=traj.turns, num_tool_calls=len(traj.tool_calls))
        try:
            result = ep.task.score(ep.instance, outcome)
        except Exception as err:  # noqa: BLE001 - an evaluator error is not the policy's fault
            log.warning("scoring %s failed: %s", traj.trajectory_id, err, exc_info=True)
            traj.status, traj.truncation = TrajectoryStatus.INFRA_INVALID, None
            traj.metadata["end_reason"] = f"evaluator error: {type(err).__name__}: {err}"
            return
        traj.rewards, traj.reward_evaluators, traj.reward = result.rewards, result.evaluators, result.total
        traj.metadata["answer"] = ep.answer
        ep.timings["reward_s"] = time.monotonic() - started
        trace(traj, "reward", seconds=ep.timings["reward_s"], total=result.total, components=dict(result.rewards),
              evaluators=dict(result.evaluators))

    def stats(self, wall_s: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {**self.counts, "engine_requests": self.meter.requests,
                               "engine_tokens": self.meter.tokens, "engine_busy_s": self.meter.busy()}
        if wall_s:
            out["engine_busy_fraction"] = self.meter.busy() / wall_s
        out["tools"] = self.tools.stats()
        return out


async def _within_budget(ep: _Episode, awaitable, stop: asyncio.Event | None, timing: str):
    """The result of `awaitable` (a tool batch, an env step), cancelled when the episode's wall-clock
    budget runs out (TRUNCATED) or a stop is requested (ABORTED); its time goes to ep.timings[timing]."""
    started = time.monotonic()
    fut = asyncio.ensure_future(awaitable)
    which = await _race(fut, ep.deadline_at, stop)
    ep.timings[timing] += time.monotonic() - started
    if which != "done":
        fut.cancel()
        if which == "deadline":
            raise _End(TrajectoryStatus.TRUNCATED, Truncation.WALL_CLOCK)
        raise _End(TrajectoryStatus.ABORTED, reason="stop requested")
    return fut.result()


async def _race(fut: asyncio.Future, deadline: Callable[[], float], stop: asyncio.Event | None) -> str:
    """Wait for `fut` until the deadline or a stop request: "done" | "deadline" | "stop". The
    deadline is read again when the wait times out (a pause moves it)."""
    waiters = {fut}
    stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stopper is not None:
        waiters.add(stopper)
    try:
        while True:
            timeout = max(0.0, deadline() - time.monotonic())
            done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if done or time.monotonic() >= deadline():
                break
    finally:
        if stopper is not None:
            stopper.cancel()
    if fut in done:
        fut.result()          # re-raise an engine / tool exception here
        return "done"
    return "stop" if stopper is not None and stopper in done else "deadline"


async def run_episodes(engine: Any, tokenizer: Any, tasks: Sequence[TaskInstance], *,
                       task: Task | dict[str, Task],
                       group_size: int, agent_cfg: AgentConfig, tools: ToolBox, run_id: str, seed: int = 0,
                       step: int = 0, envs: EnvProvider | None = None,
                       stop: asyncio.Event | None = None) -> list[Trajectory]:
    """`group_size` episodes per instance of `tasks` on `engine`; see `AgentRunner.run`."""
    runner = AgentRunner(engine, tokenizer, agent_cfg=agent_cfg, tools=tools, run_id=run_id, envs=envs,
                         seed=seed)
    return await runner.run(tasks, task=task, group_size=group_size, step=step, stop=stop)
