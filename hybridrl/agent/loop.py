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

This is one front end of the episode engine (`agent/episodes.py`): admission, attempts, budgets,
seeds, the turn's requests to the engine (segments, versions, routing records), scoring and the
trajectory's bookkeeping are the engine's, shared with the gateway; what is here is the part only
the built-in loop has: reading actions from the policy's tokens and answering them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Sequence

from hybridrl.agent.actions import ActionError, ActionParser, ToolAuthorizer, ToolCall
from hybridrl.agent.chat import ChatFormat
from hybridrl.agent.config import AgentConfig
from hybridrl.agent.env_sessions import EnvProvider
from hybridrl.agent.episodes import Episode, EpisodeEnd, EpisodeEngine, within_budget
from hybridrl.agent.turns import TurnOutput
from hybridrl.agent.tools.base import ToolBox
from hybridrl.data.episode import TaskInstance
from hybridrl.data.trace import close_turn, generate_event, trace
from hybridrl.data.trajectory import ToolCallRecord, Trajectory, TrajectoryStatus, Truncation
from hybridrl.envs.tasks.base import Task
from hybridrl.rollout.protocol import FinishReason

log = logging.getLogger(__name__)


class AgentRunner(EpisodeEngine):
    """The built-in agent loop (see the module doc). Keep one per rollout phase (it accumulates stats)."""

    COUNTERS = ("episodes", "agent_errors", "malformed_actions", "unauthorized_actions", "invalid_arguments",
                "too_many_calls", "tool_calls", "tool_errors")
    SAVES_EPISODES = True      # its state between requests is the trajectory and the turn in progress

    def __init__(self, engine: Any, tokenizer: Any, *, agent_cfg: AgentConfig, tools: ToolBox, run_id: str,
                 envs: EnvProvider | None = None, seed: int = 0):
        super().__init__(engine, agent_cfg=agent_cfg, tools=tools, run_id=run_id, envs=envs, seed=seed)
        self.chat = ChatFormat(tokenizer, eos_token_ids=engine.eos_token_ids)

    @classmethod
    def from_config(cls, cfg: Any, engine: Any, tokenizer: Any, *, tools: Any, envs: Any = None) -> "AgentRunner":
        return cls(engine, tokenizer, agent_cfg=cfg.agent, tools=tools, run_id=cfg.run.name, seed=cfg.run.seed,
                   envs=envs)

    def parser(self, task: Task) -> ActionParser:
        """How this runner reads an assistant turn of `task`: the task's action formats (one parser
        per episode, so a subclass may return a stateful one)."""
        return ActionParser(task.action_formats)

    # ------------------------------------------------------------------ one episode

    async def drive(self, ep: Episode) -> None:
        cfg, traj = ep.cfg, ep.traj
        authorizer = ToolAuthorizer(self.tools.specs, ep.instance.tools)
        tool_json = [authorizer.specs[n].to_json() for n in authorizer.allowed] if ep.task.render_tools else None
        resumed = ep.resume_turn.turn if ep.resume_turn is not None else None   # a saved episode's open turn
        if resumed is None:
            messages = list(ep.instance.messages)
            ep.session = self.envs.session(ep.task, ep.instance, seed=ep.seed, episode_key=traj.trajectory_id)
            extra = await ep.session.reset() if ep.session is not None else None
            if extra:
                messages.append({"role": "user", "content": self.chat.sanitize(extra, cfg.max_observation_chars)})
            traj.prompt_ids = self.chat.prompt_ids(messages, tools=tool_json)
            ep.messages = messages
        parser = self.parser(ep.task)
        for turn in range(resumed or 0, cfg.max_turns):
            if turn != resumed:
                close_turn(ep)
                ep.open_turn = (turn, dict(ep.timings), len(traj.response_ids))
            ids, finish = await self._turn(ep, turn)
            traj.turns = turn + 1
            ep.final_text = text = self.chat.decode(ids)
            ep.messages.append({"role": "assistant", "content": text})
            parsed = parser.parse(text)
            trace(traj, "parse", turn=turn, answer=parsed.answer is not None, num_answers=parsed.num_answers,
                  calls=len(parsed.calls), errors=len(parsed.errors))
            ep.answer, ep.num_answers = parsed.answer, parsed.num_answers
            ended_with_eos = bool(ids) and ids[-1] in self.chat.eos_ids
            if parsed.answer is not None or not parsed.has_action:
                if ep.session is None:
                    if parsed.answer is None:
                        raise EpisodeEnd(TrajectoryStatus.FAILED,
                                         reason="the turn has neither an action nor an answer")
                    raise EpisodeEnd(TrajectoryStatus.COMPLETED)
                obs_messages = await self._env_step(ep, text, parsed.answer)
            else:
                if turn == cfg.max_turns - 1:
                    raise EpisodeEnd(TrajectoryStatus.TRUNCATED, Truncation.MAX_TURNS)
                obs_messages = await self._act(ep, turn, parsed.calls, parsed.errors, authorizer)
            if turn == cfg.max_turns - 1:
                raise EpisodeEnd(TrajectoryStatus.TRUNCATED, Truncation.MAX_TURNS)
            self._append_observation(ep, obs_messages, ended_with_eos)

    # ------------------------------------------------------------------ generation

    async def _turn(self, ep: Episode, turn: int) -> tuple[list[int], FinishReason]:
        """One assistant turn (the engine's turn core); appends its tokens, segment by segment."""
        cfg, traj = ep.cfg, ep.traj
        used = len(traj.response_ids)
        bounds = {Truncation.MAX_RESPONSE_TOKENS: cfg.max_response_tokens - used,   # ties: the first wins
                  Truncation.CONTEXT: self.max_model_len - len(traj.prompt_ids) - used,
                  Truncation.MAX_NEW_TOKENS: cfg.max_new_tokens_per_turn}
        limit, room = min(bounds.items(), key=lambda kv: kv[1])
        if room < 1:
            raise EpisodeEnd(TrajectoryStatus.TRUNCATED, limit)
        out = await self.generate_turn(ep, self.engine, traj.prompt_ids + traj.response_ids, room, turn=turn)
        self._append_turn(ep, turn, out)
        if out.cut == "deadline":
            raise EpisodeEnd(TrajectoryStatus.TRUNCATED, Truncation.WALL_CLOCK)
        if out.cut == "stop":
            raise EpisodeEnd(TrajectoryStatus.ABORTED, reason="stop requested")
        finish = out.finish
        if finish == FinishReason.STOP:
            return out.ids, finish
        if finish == FinishReason.LENGTH:
            if limit == Truncation.MAX_NEW_TOKENS and cfg.on_turn_limit == "close_turn":
                traj.metadata["turns_cut"] = traj.metadata.get("turns_cut", 0) + 1
                return out.ids, finish
            raise EpisodeEnd(TrajectoryStatus.TRUNCATED, limit)
        if finish == FinishReason.CONTEXT:
            raise EpisodeEnd(TrajectoryStatus.TRUNCATED, Truncation.CONTEXT)
        raise EpisodeEnd(TrajectoryStatus.ABORTED, reason=f"the engine ended the request: {finish.value}")

    @staticmethod
    def _append_turn(ep: Episode, turn: int, out: TurnOutput) -> None:
        traj = ep.traj
        for seg, (rid, sampling) in zip(out.segments, out.requests):
            generate_event(traj, turn, rid, sampling, seg, start=len(traj.response_ids))
            traj.append(seg.token_ids, policy=True, logprobs=seg.logprobs, version=seg.policy_version,
                        routed_experts=seg.routed_experts)
            traj.sampler_contract = seg.sampler_contract

    # ------------------------------------------------------------------ actions

    async def _act(self, ep: Episode, turn: int, calls: Sequence[ToolCall], errors: Sequence[ActionError],
                   authorizer: ToolAuthorizer) -> list[dict[str, str]]:
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
        run = [self.tools.call(call, context=tool_context(ep, f"t{turn}.{i}"))
               for i, (call, _) in enumerate(plan) if call is not None]
        results = iter(await within_budget(ep, asyncio.gather(*run), "tool_s"))
        messages = []
        for call, problem in plan:
            if problem is not None:
                messages.append(self._refused(ep, turn, problem))
                continue
            result = next(results)
            self.counts["tool_calls"] += 1
            self.counts["tool_errors"] += not result.ok
            traj.tool_calls.append(ToolCallRecord(turn=turn, name=call.name, ok=result.ok, error=result.error,
                                                  latency_s=result.latency_s))
            trace(traj, "action", turn=turn, tool=call.name, decision="authorized", format=call.format,
                  ok=result.ok, error=result.error, infra_error=bool(result.infra_error), latency_s=result.latency_s)
            if result.infra_error:
                raise EpisodeEnd(TrajectoryStatus.INFRA_INVALID, reason=f"tool {call.name}: {result.error}")
            messages.append({"role": "tool", "content": result.text})
        return messages

    def _refused(self, ep: Episode, turn: int, problem: ActionError) -> dict[str, str]:
        """A call that was not run (malformed, unauthorized, over the per-turn limit): the model sees why."""
        traj = ep.traj
        trace(traj, "action", turn=turn, tool=problem.tool, decision=problem.kind, message=problem.message)
        self.counts[{"malformed": "malformed_actions", "unauthorized": "unauthorized_actions"}
                    .get(problem.kind, problem.kind)] += 1
        traj.metadata[f"num_{problem.kind}"] = traj.metadata.get(f"num_{problem.kind}", 0) + 1
        traj.tool_calls.append(ToolCallRecord(turn=turn, name=problem.tool, ok=False,
                                              error=f"{problem.kind}: {problem.message}"))
        return {"role": "tool", "content": f"error: {problem.message}"}

    async def _env_step(self, ep: Episode, text: str, answer: str | None) -> list[dict[str, str]]:
        assert ep.session is not None
        started = time.monotonic()
        transition = await within_budget(ep, ep.session.step({"text": text, "answer": answer}), "env_s")
        trace(ep.traj, "env_step", turn=ep.open_turn[0] if ep.open_turn else -1, reward=transition.reward,
              done=transition.done, seconds=time.monotonic() - started,
              info={k: v for k, v in transition.info.items() if isinstance(v, (int, float, str, bool))})
        ep.env_return += transition.reward
        ep.traj.metadata["env_steps"] = ep.traj.metadata.get("env_steps", 0) + 1
        if transition.done:
            raise EpisodeEnd(TrajectoryStatus.COMPLETED)
        return [{"role": transition.role, "content": transition.observation or ""}]

    def _append_observation(self, ep: Episode, messages: list[dict[str, str]], after_eos: bool) -> None:
        traj = ep.traj
        clean = [{"role": m["role"], "content": self.chat.sanitize(m["content"], ep.cfg.max_observation_chars)}
                 for m in messages]
        ids = self.chat.observation_ids(clean, after_eos=after_eos)
        if len(traj.response_ids) + len(ids) > ep.cfg.max_response_tokens:
            raise EpisodeEnd(TrajectoryStatus.TRUNCATED, Truncation.MAX_RESPONSE_TOKENS,
                             reason="the next observation does not fit the response budget")
        if len(traj.prompt_ids) + len(traj.response_ids) + len(ids) >= self.max_model_len:
            raise EpisodeEnd(TrajectoryStatus.TRUNCATED, Truncation.CONTEXT,
                             reason="the next observation does not fit the context")
        trace(traj, "observation", turn=ep.open_turn[0] if ep.open_turn else -1, start=len(traj.response_ids),
              end=len(traj.response_ids) + len(ids), roles=[m["role"] for m in clean])
        traj.append(ids, policy=False)
        ep.messages.extend(clean)


def tool_context(ep: Episode, call: str) -> dict[str, Any]:
    """What a tool is told about the call (`Tool.call(..., context=...)`): the episode's id, the call's id
    within it, and the episode's instance (its per-episode state: a tool may read `context["instance"]`)."""
    return {"episode": ep.traj.trajectory_id, "call": call, "instance": ep.instance}


async def run_episodes(engine: Any, tokenizer: Any, tasks: Sequence[TaskInstance], *,
                       task: Task | dict[str, Task],
                       group_size: int, agent_cfg: AgentConfig, tools: ToolBox, run_id: str, seed: int = 0,
                       step: int = 0, envs: EnvProvider | None = None,
                       stop: Any = None) -> list[Trajectory]:
    """`group_size` episodes per instance of `tasks` on `engine`; see `EpisodeEngine.run`."""
    runner = AgentRunner(engine, tokenizer, agent_cfg=agent_cfg, tools=tools, run_id=run_id, envs=envs,
                         seed=seed)
    return await runner.run(tasks, task=task, group_size=group_size, step=step, stop=stop)
