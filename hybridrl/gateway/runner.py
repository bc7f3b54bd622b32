"""`GatewayRunner`: episodes of an OpenAI-client agent (`task.agent`): the gateway's front end of the
episode engine (`agent/episodes.py`).

Admission, attempts, `Task.for_instance` and the task's budgets, group checks, seeds, the turn's requests to
the engine (segments, per-token versions, routing records), scoring and the trajectory's bookkeeping are the
engine's, shared with the built-in agent loop. What is here is the part only this door has. One episode:

    issue a key -> give the agent an AsyncOpenAI client with it -> await the agent
      (its requests: gateway -> capture -> the engine's turn core; budgets refused at the gateway)
    -> the key dies (requests still in flight are aborted) -> the trajectory is the chain the agent ended on
       (capture.py `EpisodeCapture.final`: prompt mask 0, generated ids mask 1 with their logprobs, versions
       and routing records, the template's ids between turns mask 0) -> status -> reward: the agent's own,
       or the task's verifier on its Outcome

Status: COMPLETED (the agent returned), TRUNCATED (a budget ended it, whatever the agent did then), ABORTED
(a stop, the engine ended a request, or the episode ended on several completions and the agent did not say
which it used), FAILED (the agent raised: a scored failure, `agent.on_agent_error`), INFRA_INVALID (the
gateway or a tool failed: nothing the policy or the agent is answerable for). An agent that makes no request
is an agent error with nothing to score: dropped, counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import lru_cache, partial
from typing import Any, Callable

from hybridrl.agent.episodes import AgentError, Episode, EpisodeEnd, EpisodeEngine
from hybridrl.agent.turns import race
from hybridrl.data.trace import generate_event, trace
from hybridrl.data.trajectory import TrajectoryStatus, Truncation
from hybridrl.envs.agent_spec import load_agent
from hybridrl.gateway.agent import CURRENT_TOOLS, EpisodeTools, Outcome
from hybridrl.gateway.capture import EpisodeCapture, Template
from hybridrl.gateway.episodes import Budgets, EpisodeKeys, GatewayEpisode
from hybridrl.gateway.routing import Replica, Router
from hybridrl.gateway.server import HttpServer, build_app
from hybridrl.gateway.service import GatewayService
from hybridrl.gateway.toolcalls import TurnParser, choose_parsers

log = logging.getLogger(__name__)

COUNTERS = ("episodes", "agent_errors", "gateway_requests", "budget_refusals", "template_drift", "token_drift",
            "gateway_splits", "gateway_branches", "sampling_overridden", "tool_calls", "tool_errors",
            "malformed_actions", "untrained_policy_tokens", "ambiguous_final", "disconnected")


class GatewayRunner(EpisodeEngine):
    """Runs `agent` episodes against `engines` (the replicas this rank fronts; the first is `engine`)."""

    COUNTERS = COUNTERS

    def __init__(self, engines: Any, tokenizer: Any, *, agent_cfg: Any, gateway_cfg: Any, tools: Any, run_id: str,
                 agent: str | Callable, seed: int = 0, server_thread: bool | None = None):
        engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        super().__init__(engines[0], agent_cfg=agent_cfg, tools=tools, run_id=run_id, seed=seed)
        self.gateway_cfg = gateway_cfg
        self.agent_spec = agent if isinstance(agent, str) else f"{agent.__module__}:{agent.__qualname__}"
        self.agent = load_agent(agent) if isinstance(agent, str) else agent
        # HTTP on its own loop and thread (False: on the engine's loop); gateway.http_thread unless given
        self.server_thread = gateway_cfg.http_thread if server_thread is None else server_thread
        self.router = Router([Replica(e, f"replica{i}") for i, e in enumerate(engines)],
                             affinity_slack=gateway_cfg.prefix_affinity_slack)
        self.template = Template(tokenizer, self.engine.eos_token_ids)
        tool_parser, reasoning = choose_parsers(gateway_cfg.tool_parser, gateway_cfg.reasoning_parser,
                                                self.template.source)
        self.parser = TurnParser(tool_parser, reasoning)
        self.keys = EpisodeKeys()
        self.service = GatewayService(self.template, self.router, self.parser, turns=self,
                                      model_name=gateway_cfg.model_name, render_tools=gateway_cfg.render_tools)
        self.max_model_len = int(min((e.max_model_len or 1 << 30) for e in engines))
        self.server: HttpServer | None = None
        self._http: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Future | None = None

    @classmethod
    def from_config(cls, cfg: Any, engine: Any, tokenizer: Any, *, tools: Any, envs: Any = None) -> "GatewayRunner":
        return cls(engine, tokenizer, agent_cfg=cfg.agent, gateway_cfg=cfg.gateway, tools=tools, run_id=cfg.run.name,
                   agent=cfg.task.agent, seed=cfg.run.seed)

    # ------------------------------------------------------------------ the server

    async def start(self) -> None:
        """Start the gateway (once): its HTTP server (in its own thread with `gateway.http_thread`), and the
        episodes' client on the running loop, which is the engine's loop the episodes run on (a later call
        from another loop is refused)."""
        loop = asyncio.get_running_loop()
        if self._starting is None:
            self._loop, self._starting = loop, loop.create_future()
            try:
                server = HttpServer(build_app(self.service, self.keys, self.gateway_cfg), listen=self.gateway_cfg.listen,
                                    host=self.gateway_cfg.host, port=self.gateway_cfg.port,
                                    own_thread=self.server_thread, limits=self.gateway_cfg)
                await server.start()
                self.server = server
                self._http = _http_client(server, limit=self.cfg.max_concurrent_episodes,
                                          timeout=self.cfg.max_episode_s + self.gateway_cfg.agent_grace_s + 30)
                self._starting.set_result(None)
            except BaseException as err:
                self._starting.set_exception(err)
                self._starting.exception()          # retrieved: raised below and to every waiter
                self._starting = None
                raise
        if loop is not self._loop:
            raise RuntimeError("the gateway runs on the event loop it was started on; this is another one")
        await asyncio.shield(self._starting)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self.server is not None:
            await self.server.stop()
            self.server = None
        self._starting = None

    def client(self, key: str) -> Any:
        """An AsyncOpenAI client of one episode (no retries: a refused request is the episode's answer)."""
        import openai

        client = openai.AsyncOpenAI(api_key=key, base_url=self.server.base_url, http_client=self._http, max_retries=0)
        # The client looks up the platform for its headers in a worker thread before its first request; that
        # thread's finish would decide when each episode's first request reaches the engine (and so which
        # requests share a batch: the last bits of their logprobs). Looked up once here, on the loop.
        client._platform = _platform()
        return client

    # ------------------------------------------------------------------ one episode (the engine's hooks)

    def open(self, ep: Episode) -> GatewayEpisode:
        cfg = ep.cfg
        capture = EpisodeCapture(self.template, on_drift=self.gateway_cfg.on_drift,
                                 check_tokens=self.gateway_cfg.check_tokens, max_tool_chars=cfg.max_observation_chars,
                                 specials_as_text=self.gateway_cfg.special_tokens_in_messages == "text")
        budgets = Budgets(max_turns=cfg.max_turns, max_new_tokens_per_turn=cfg.max_new_tokens_per_turn,
                          max_response_tokens=cfg.max_response_tokens, max_episode_s=cfg.max_episode_s,
                          close_turn_at_limit=cfg.on_turn_limit == "close_turn", max_model_len=self.max_model_len)
        fields = {f: getattr(ep, f) for f in Episode.__dataclass_fields__}       # the engine's record, extended
        episode = GatewayEpisode(**fields, key=EpisodeKeys.new_key(), capture=capture, budgets=budgets,
                                 loop=asyncio.get_running_loop())
        self.keys.add(episode)
        return episode

    async def drive(self, ep: Episode) -> None:
        episode: GatewayEpisode = ep        # type: ignore[assignment]
        tools = EpisodeTools(self.tools, tuple(ep.instance.tools), ep.traj.trajectory_id,
                             partial(self._tool_result, episode), instance=ep.instance)
        token = CURRENT_TOOLS.set(tools)
        try:
            agent = asyncio.ensure_future(self.agent(self.client(episode.key), ep.instance))
        finally:
            CURRENT_TOOLS.reset(token)
        if await self._wait_for(episode, agent):
            try:
                episode.outcome = agent.result()
            except Exception as err:  # noqa: BLE001 - the agent's own error
                if not (episode.truncation is not None and _is_status_error(err)):
                    raise AgentError(f"the agent raised {type(err).__name__}: {err}", err) from None
        raise self._ending(episode)

    async def _wait_for(self, episode: GatewayEpisode, agent: asyncio.Future) -> bool:
        """Whether the agent returned within the episode's wall clock (+ gateway.agent_grace_s); on a stop or
        past the clock it is cancelled."""
        grace = self.gateway_cfg.agent_grace_s
        try:
            which = await race(agent, lambda: episode.deadline_at() + grace, episode.stop_waiter())
        except Exception:  # noqa: BLE001 - the agent's own error: `drive` reads it from the future
            return True
        if which == "done":
            return True
        agent.cancel()
        await asyncio.gather(agent, return_exceptions=True)
        if episode.stop is not None and episode.stop.is_set():     # "stop", or a stop as the clock ran out
            raise EpisodeEnd(TrajectoryStatus.ABORTED, reason="stop requested")
        episode.truncate(Truncation.WALL_CLOCK, "the agent did not return within agent.max_episode_s + "
                                                "gateway.agent_grace_s")
        return False

    def _ending(self, episode: GatewayEpisode) -> EpisodeEnd:
        """How an episode whose agent returned (or ran out of time) ended, from what the gateway saw."""
        if episode.infra_error:
            return EpisodeEnd(TrajectoryStatus.INFRA_INVALID, reason=episode.infra_error)
        if episode.aborted:
            return EpisodeEnd(TrajectoryStatus.ABORTED, reason=episode.end_reason)
        if episode.truncation is not None:
            return EpisodeEnd(TrajectoryStatus.TRUNCATED, episode.truncation, episode.end_reason)
        return EpisodeEnd(TrajectoryStatus.COMPLETED)

    def _tool_result(self, episode: GatewayEpisode, result: Any, name: str) -> None:
        episode.executions.append({"turn": max(0, episode.turns - 1), "tool": name, "ok": result.ok,
                                   "error": result.error, "latency_s": result.latency_s})
        self.counts["tool_calls"] += 1
        self.counts["tool_errors"] += not result.ok
        if result.infra_error and not episode.infra_error:
            episode.infra_error = f"tool: {result.error}"

    async def release(self, ep: Episode) -> None:
        """The key dies; requests the agent left running are aborted and waited for."""
        episode: GatewayEpisode = ep        # type: ignore[assignment]
        self.keys.remove(episode)
        if episode.replica is None:
            return
        for rid in list(episode.in_flight):
            try:
                await episode.replica.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine may be gone; nothing to keep
                pass
        waited = time.monotonic()
        while episode.in_flight and time.monotonic() - waited < self.cfg.abort_grace_s + 1.0:
            await asyncio.sleep(0.005)
        self.router.release(episode.replica, episode.group_id)

    # ------------------------------------------------------------------ the record

    def finish(self, ep: Episode) -> None:
        """The trajectory from the chain the agent ended on; the outcome's fields for the verifier."""
        episode: GatewayEpisode = ep        # type: ignore[assignment]
        traj = ep.traj
        outcome = episode.outcome
        named = outcome if isinstance(outcome, Outcome) else Outcome()
        chain, why = episode.capture.choose(completion=named.completion, choice=named.choice,
                                           text=_outcome_text(outcome))
        if chain is not None:
            p = chain.prompt_len
            traj.prompt_ids = chain.ids[:p]
            traj.response_ids, traj.response_mask = chain.ids[p:], chain.mask[p:]
            traj.behavior_logprobs, traj.policy_versions = chain.logprobs[p:], chain.versions[p:]
            traj.routed_experts = chain.routes
            ep.final_text = chain.final_text
        else:
            traj.prompt_ids = self.template.encode(self.template.render(list(ep.instance.messages)))
        traj.turns, traj.tool_calls = episode.turns, list(episode.tool_calls)
        trace_chain(episode, chain)
        traj.sampler_contract = episode.sampler_contract
        self._count(episode, chain)
        traj.metadata.update(self._metadata(episode, chain))
        self._settle(episode, chain, why)
        self._take_outcome(episode, outcome)

    def _settle(self, episode: GatewayEpisode, chain: Any, why: str) -> None:
        """The status once the trajectory is known: an agent that made no request, or an episode whose final
        completion is ambiguous, has nothing to train on."""
        traj = episode.traj
        if traj.status in (TrajectoryStatus.INFRA_INVALID, TrajectoryStatus.ABORTED) or chain is not None:
            return
        if why == "no_request":
            if "agent_error" not in traj.metadata:
                self.counts["agent_errors"] += 1
                traj.metadata["agent_error"] = "the agent made no request"
            traj.status, traj.truncation = TrajectoryStatus.ABORTED, None
            traj.metadata["end_reason"] = "agent error: the agent made no request"
            return
        self.counts["ambiguous_final"] += 1
        traj.status, traj.truncation = TrajectoryStatus.ABORTED, None
        traj.metadata["end_reason"] = why

    def _take_outcome(self, episode: GatewayEpisode, outcome: Any) -> None:
        if isinstance(outcome, bool) or not isinstance(outcome, (int, float, Outcome)):
            outcome = Outcome()
        if isinstance(outcome, (int, float)):
            episode.own_reward = float(outcome)
            return
        if outcome.reward is not None:
            episode.own_reward = float(outcome.reward)
        episode.answer = outcome.answer
        episode.num_answers = outcome.num_answers if outcome.num_answers is not None else int(outcome.answer is not None)
        if outcome.final_text is not None:
            episode.final_text = outcome.final_text
        if outcome.metadata:
            episode.traj.metadata["agent"] = dict(outcome.metadata)

    def own_reward_evaluator(self) -> str:
        return f"agent:{self.agent_spec}"

    def _metadata(self, episode: GatewayEpisode, chain: Any) -> dict[str, Any]:
        counts = episode.capture.counts
        out = {"gateway_requests": counts["requests"], "template_drift": counts["template_drift"],
               "token_drift": counts["token_drift"], "gateway_segments": counts["roots"],
               "reused_tokens": counts["reused_tokens"], "encoded_tokens": counts["encoded_tokens"]}
        if chain is not None:
            out["untrained_policy_tokens"] = episode.capture.policy_tokens - chain.num_policy_tokens
            out["chain_template_drift"], out["chain_token_drift"] = chain.template_drift, chain.token_drift
        out.update({k: v for k, v in episode.counts.items() if v})
        return out

    def _count(self, episode: GatewayEpisode, chain: Any) -> None:
        c, captured = self.counts, episode.capture.counts
        c["gateway_requests"] += captured["requests"]
        c["template_drift"] += captured["template_drift"]
        c["token_drift"] += captured["token_drift"]
        c["gateway_splits"] += captured["splits"]
        c["gateway_branches"] += captured["branches"]
        c["sampling_overridden"] += episode.counts["sampling_overridden"]
        c["malformed_actions"] += episode.counts["malformed_tool_calls"]
        c["disconnected"] += episode.counts["disconnected"]
        c["budget_refusals"] += int(episode.truncation is not None)
        if chain is not None:
            c["untrained_policy_tokens"] += episode.capture.policy_tokens - chain.num_policy_tokens

    def stats(self, wall_s: float | None = None) -> dict[str, Any]:
        return {**super().stats(wall_s), "router": self.router.stats(), "service": dict(self.service.counts)}


def trace_chain(episode: GatewayEpisode, chain: Any) -> None:
    """The trajectory's trace (data/trace.py), as the built-in loop writes it, from the chain it trains: per
    completion its engine requests (`generate`), what the turn parser read (`parse`, a `malformed` action per
    call that did not parse), the hybridrl tools the agent ran after it (`action`), and the template's tokens
    before the next completion (`observation`). No `turn` events: the gateway does not time the agent's turns."""
    traj, p = episode.traj, chain.prompt_len if chain is not None else 0
    runs = list(episode.executions)
    end, last = None, -1
    for step in chain.steps if chain is not None else []:
        start = step["start"] - p
        if end is not None and start > end:
            trace(traj, "observation", turn=last, start=end, end=start, roles=step["roles"])
        at = start
        for (rid, sampling), out in step.get("requests", []):
            generate_event(traj, step.get("turn", 0), rid, sampling, out, start=at)
            at += len(out.token_ids)
        turn = step.get("turn", 0)
        trace(traj, "parse", turn=turn, answer=None, num_answers=None, calls=step.get("calls", 0),
              errors=step.get("malformed", 0))
        for _ in range(step.get("malformed", 0)):
            trace(traj, "action", turn=turn, tool="?", decision="malformed", message="the tool call does not parse")
        for run in [r for r in runs if r["turn"] == turn]:
            trace(traj, "action", decision="authorized", **run)
            runs.remove(run)
        end, last = step["end"] - p, turn
    for run in runs:                       # tools run after completions the trajectory does not train
        trace(traj, "action", decision="authorized", **run)


def _outcome_text(outcome: Any) -> str | None:
    if not isinstance(outcome, Outcome):
        return None
    return outcome.final_text if outcome.final_text is not None else outcome.answer


def _is_status_error(err: BaseException) -> bool:
    return isinstance(getattr(err, "status_code", None), int)


@lru_cache(maxsize=1)
def _platform() -> Any:
    from openai._base_client import get_platform

    return get_platform()


def _http_client(server: HttpServer, *, limit: int, timeout: float) -> Any:
    """The one HTTP client every episode's OpenAI client shares (a connection pool over the gateway's
    socket), in the flavour the installed openai package takes."""
    import openai

    factory = getattr(openai, "DefaultAsyncHttpx2Client", None)
    if factory is not None:
        import httpx2 as httpx
    else:
        import httpx

        factory = openai.DefaultAsyncHttpxClient
    # idle connections are kept (no expiry): one that expired after a few idle seconds would be opened again
    # by the next request, an extra round on the loop whose place depends on how long the step took
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit, keepalive_expiry=None)
    transport = httpx.AsyncHTTPTransport(uds=str(server.socket_path), limits=limits) \
        if server.socket_path is not None else httpx.AsyncHTTPTransport(limits=limits)
    return factory(transport=transport, timeout=timeout, trust_env=False)
