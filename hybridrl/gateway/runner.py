"""`GatewayRunner`: episodes of an OpenAI-client agent (`task.agent`), run through the gateway.

It stands where the built-in `AgentRunner` stands (`RolloutSide` picks one with `agent_runner`): the same
`run_attempts` / `_admit` / `run_episode` calls, the same `Trajectory` records, so collection (sync,
partial, disaggregated), filters, the ledger and training do not know which ran. One episode:

    issue a key -> give the agent an AsyncOpenAI client with it -> await the agent
      (its requests: gateway -> capture -> engine; budgets refused at the gateway)
    -> the key dies (requests still in flight are aborted) -> the trajectory is the last completion's
       chain (prompt mask 0, generated ids mask 1 with their logprobs and versions, the template's ids
       between turns mask 0) -> status -> reward: the agent's own, or the task's verifier on its Outcome

Status: COMPLETED (the agent returned), TRUNCATED (a budget ended it, whatever the agent did then),
ABORTED (a stop, or the engine ended a request), INFRA_INVALID (the agent raised, the gateway or a tool
failed, or no request was made: nothing the policy is answerable for).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Callable, Sequence

from hybridrl.agent.pause import Slot
from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.data.trajectory import Trajectory, TrajectoryStatus, Truncation
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
            "malformed_actions", "untrained_policy_tokens")


class GatewayRunner:
    """Runs `agent` episodes against `engines` (the replicas this rank fronts; the first is `engine`)."""

    def __init__(self, engines: Any, tokenizer: Any, *, agent_cfg: Any, gateway_cfg: Any, tools: Any, run_id: str,
                 agent: str | Callable, seed: int = 0, server_thread: bool | None = None):
        engines = list(engines) if isinstance(engines, (list, tuple)) else [engines]
        self.engine = engines[0]
        self.cfg, self.gateway_cfg = agent_cfg, gateway_cfg
        self.tools, self.run_id, self.seed = tools, run_id, seed
        self.envs = None                        # an agent drives its episodes: no environment service
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
        self.service = GatewayService(self.template, self.router, self.parser, agent_cfg=agent_cfg,
                                      model_name=gateway_cfg.model_name, render_tools=gateway_cfg.render_tools,
                                      abort_grace_s=agent_cfg.abort_grace_s)
        self.max_model_len = int(min((e.max_model_len or 1 << 30) for e in engines))
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.server: HttpServer | None = None
        self._http: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Future | None = None
        self._slots: asyncio.Semaphore | None = None

    # ------------------------------------------------------------------ the server

    async def start(self) -> None:
        """Start the gateway (once): its HTTP server (in its own thread with `gateway.http_thread`), and the
        episodes' client on the running loop, which is the engine's loop the episodes run on (a later call
        from another loop is refused)."""
        loop = asyncio.get_running_loop()
        if self._starting is None:
            self._loop, self._starting = loop, loop.create_future()
            try:
                server = HttpServer(build_app(self.service, self.keys), listen=self.gateway_cfg.listen,
                                    host=self.gateway_cfg.host, port=self.gateway_cfg.port,
                                    own_thread=self.server_thread)
                await server.start()
                self.server = server
                self._http = _http_client(server, limit=self.cfg.max_concurrent_episodes,
                                          timeout=self.cfg.max_episode_s + self.gateway_cfg.agent_grace_s + 30)
                self._slots = asyncio.Semaphore(self.cfg.max_concurrent_episodes)
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

        return openai.AsyncOpenAI(api_key=key, base_url=self.server.base_url, http_client=self._http, max_retries=0)

    # ------------------------------------------------------------------ many episodes (AgentRunner's calls)

    async def run(self, tasks: Sequence[TaskInstance], *, task: Any, group_size: int = 1, step: int = 0,
                  stop: asyncio.Event | None = None, temperature: float | None = None) -> list[Trajectory]:
        attempts = [(inst, a, f"{inst.task_id}@{step}") for inst in tasks for a in range(group_size)]
        return await self.run_attempts(attempts, task=task, stop=stop, temperature=temperature)

    async def run_attempts(self, attempts: Sequence[tuple[TaskInstance, int, str]], *, task: Any,
                           stop: asyncio.Event | None = None, temperature: float | None = None,
                           pause: Any = None) -> list[Trajectory]:
        coros = [self._admit(inst, task if not isinstance(task, dict) else task[inst.task], attempt, group_id, stop,
                             temperature, pause) for inst, attempt, group_id in attempts]
        return list(await asyncio.gather(*coros))

    async def _admit(self, inst: TaskInstance, task: Any, attempt: int, group_id: str, stop: asyncio.Event | None,
                     temperature: float | None, pause: Any = None) -> Trajectory:
        await self.start()
        queued = time.monotonic()
        slot = Slot(self._slots)
        await slot.take()
        try:
            return await self.run_episode(inst, task=task, attempt=attempt, group_id=group_id, stop=stop,
                                          queue_s=time.monotonic() - queued, temperature=temperature, pause=pause,
                                          slot=slot)
        finally:
            slot.give_back()

    # ------------------------------------------------------------------ one episode

    async def run_episode(self, instance: TaskInstance, *, task: Any, attempt: int = 0, group_id: str | None = None,
                          stop: asyncio.Event | None = None, queue_s: float = 0.0, temperature: float | None = None,
                          pause: Any = None, slot: Slot | None = None) -> Trajectory:
        """One episode; never raises for the episode's own problems (they become its status)."""
        await self.start()
        started = time.monotonic()
        traj = Trajectory(run_id=self.run_id, task_id=instance.task_id, group_id=group_id or instance.task_id,
                          attempt=attempt, prompt_ids=[])
        episode = self._open(traj, temperature, pause, slot)
        self.parser.action_formats = tuple(task.action_formats)
        tool_results: list[Any] = []
        tools = EpisodeTools(self.tools, tuple(instance.tools), traj.trajectory_id, tool_results.append)
        outcome, failure, stopped = None, "", False
        try:
            if stop is not None and stop.is_set():
                stopped = True
            elif getattr(self.tools, "killed", None) is not None:
                failure = f"kill switch: {self.tools.killed}"
            else:
                outcome, failure, stopped = await self._run_agent(episode, instance, tools, stop)
        finally:
            await self._close(episode)
            if pause is not None:
                pause.running.pop(traj.trajectory_id, None)
        self._fill(traj, episode, instance, task, outcome, failure, stopped, tool_results)
        traj.timings.update(generate_s=episode.generate_s, queue_s=queue_s, total_s=time.monotonic() - started)
        try:
            traj.validate()
        except ValueError as err:        # a bug, not the policy's fault: keep it out of training
            log.error("episode %s produced an inconsistent trajectory: %s", traj.trajectory_id, err)
            traj.status, traj.truncation = TrajectoryStatus.INFRA_INVALID, None
            traj.metadata["end_reason"] = f"invalid trajectory: {err}"
        return traj

    def _open(self, traj: Trajectory, temperature: float | None, pause: Any, slot: Slot | None) -> GatewayEpisode:
        cfg = self.cfg
        seed = int.from_bytes(hashlib.sha256(f"{self.seed}/{traj.trajectory_id}".encode()).digest()[:4], "little")
        capture = EpisodeCapture(self.template, on_drift=self.gateway_cfg.on_drift,
                                 check_tokens=self.gateway_cfg.check_tokens, max_tool_chars=cfg.max_observation_chars)
        budgets = Budgets(max_turns=cfg.max_turns, max_new_tokens_per_turn=cfg.max_new_tokens_per_turn,
                          max_response_tokens=cfg.max_response_tokens, max_episode_s=cfg.max_episode_s,
                          close_turn_at_limit=cfg.on_turn_limit == "close_turn", max_model_len=self.max_model_len)
        episode = GatewayEpisode(key=EpisodeKeys.new_key(), episode_id=traj.trajectory_id, group_id=traj.group_id,
                                 capture=capture, budgets=budgets,
                                 temperature=cfg.temperature if temperature is None else temperature,
                                 top_p=cfg.top_p, top_k=cfg.top_k, seed=seed, pause=pause,
                                 paused_at_start=pause.paused_s() if pause is not None else 0.0, slot=slot,
                                 loop=asyncio.get_running_loop())
        self.keys.add(episode)
        if pause is not None:
            pause.running[traj.trajectory_id] = episode
        self.counts["episodes"] += 1
        return episode

    async def _run_agent(self, episode: GatewayEpisode, instance: TaskInstance, tools: EpisodeTools,
                         stop: asyncio.Event | None) -> tuple[Any, str, bool]:
        """(what the agent returned, why it failed or "", whether a stop ended it)."""
        token = CURRENT_TOOLS.set(tools)
        try:
            agent = asyncio.ensure_future(self.agent(self.client(episode.key), instance))
        finally:
            CURRENT_TOOLS.reset(token)
        waiters = {agent} | ({asyncio.ensure_future(stop.wait())} if stop is not None else set())
        grace = self.gateway_cfg.agent_grace_s
        try:
            while True:
                timeout = max(0.0, episode.deadline_at() + grace - time.monotonic())
                done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if done or time.monotonic() >= episode.deadline_at() + grace:
                    break
        finally:
            for w in waiters - {agent}:
                w.cancel()
        if agent in done:
            try:
                return agent.result(), "", False
            except Exception as err:  # noqa: BLE001 - the agent's own error: not the policy's fault
                if episode.truncation is not None and _is_status_error(err):
                    return None, "", False       # a refused request the agent did not catch: TRUNCATED
                self.counts["agent_errors"] += 1
                log.warning("agent %s raised in episode %s: %s", self.agent_spec, episode.episode_id, err)
                return None, f"the agent raised {type(err).__name__}: {err}", False
        agent.cancel()
        await asyncio.gather(agent, return_exceptions=True)
        if stop is not None and stop.is_set():
            return None, "", True
        episode.truncate(Truncation.WALL_CLOCK, "the agent did not return within agent.max_episode_s + "
                                                "gateway.agent_grace_s")
        return None, "", False

    async def _close(self, episode: GatewayEpisode) -> None:
        """The key dies; requests the agent left running are aborted and waited for."""
        self.keys.remove(episode)
        if episode.replica is not None:
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

    def _fill(self, traj: Trajectory, episode: GatewayEpisode, instance: TaskInstance, task: Any, outcome: Any,
              failure: str, stopped: bool, tool_results: list) -> None:
        chain = episode.capture.final()
        if chain is not None:
            p = chain.prompt_len
            traj.prompt_ids = chain.ids[:p]
            traj.response_ids, traj.response_mask = chain.ids[p:], chain.mask[p:]
            traj.behavior_logprobs, traj.policy_versions = chain.logprobs[p:], chain.versions[p:]
        else:
            traj.prompt_ids = self.template.encode(self.template.render(list(instance.messages)))
        traj.turns, traj.tool_calls = episode.turns, list(episode.tool_calls)
        traj.sampler_contract = episode.sampler_contract
        infra = failure or episode.infra_error or next(
            (f"tool: {r.error}" for r in tool_results if r.infra_error), "")
        if not infra and chain is None and not stopped:
            infra = "the agent made no request"
        self._count(episode, chain, tool_results)
        traj.metadata.update(self._metadata(episode, chain))
        if infra:
            traj.status, traj.reward = TrajectoryStatus.INFRA_INVALID, 0.0
            traj.metadata["end_reason"] = infra
            return
        if stopped or episode.aborted:
            traj.status = TrajectoryStatus.ABORTED
            traj.metadata["end_reason"] = episode.end_reason or "stop requested"
        elif episode.truncation is not None:
            traj.status, traj.truncation = TrajectoryStatus.TRUNCATED, episode.truncation
            traj.metadata["end_reason"] = episode.end_reason
        else:
            traj.status = TrajectoryStatus.COMPLETED
        self._score(traj, episode, instance, task, outcome)

    def _score(self, traj: Trajectory, episode: GatewayEpisode, instance: TaskInstance, task: Any, outcome: Any) -> None:
        started = time.monotonic()
        if isinstance(outcome, (int, float)) or (isinstance(outcome, Outcome) and outcome.reward is not None):
            reward = float(outcome if not isinstance(outcome, Outcome) else outcome.reward)
            traj.rewards, traj.reward_evaluators, traj.reward = {"agent": reward}, {"agent": f"agent:{self.agent_spec}"}, reward
        else:
            got = outcome if isinstance(outcome, Outcome) else Outcome()
            answer = got.answer
            scored = EpisodeOutcome(answer=answer, num_answers=got.num_answers if got.num_answers is not None
                                    else int(answer is not None),
                                    final_text=got.final_text if got.final_text is not None else episode.final_text,
                                    completed=traj.status == TrajectoryStatus.COMPLETED, num_turns=traj.turns,
                                    num_tool_calls=len(traj.tool_calls))
            try:
                result = task.score(instance, scored)
            except Exception as err:  # noqa: BLE001 - an evaluator error is not the policy's fault
                log.warning("scoring %s failed: %s", traj.trajectory_id, err, exc_info=True)
                traj.status, traj.truncation, traj.reward = TrajectoryStatus.INFRA_INVALID, None, 0.0
                traj.metadata["end_reason"] = f"evaluator error: {type(err).__name__}: {err}"
                return
            traj.rewards, traj.reward_evaluators, traj.reward = result.rewards, result.evaluators, result.total
            traj.metadata["answer"] = answer
        if isinstance(outcome, Outcome) and outcome.metadata:
            traj.metadata["agent"] = dict(outcome.metadata)
        traj.timings["reward_s"] = time.monotonic() - started

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

    def _count(self, episode: GatewayEpisode, chain: Any, tool_results: list) -> None:
        c, captured = self.counts, episode.capture.counts
        c["gateway_requests"] += captured["requests"]
        c["template_drift"] += captured["template_drift"]
        c["token_drift"] += captured["token_drift"]
        c["gateway_splits"] += captured["splits"]
        c["gateway_branches"] += captured["branches"]
        c["sampling_overridden"] += episode.counts["sampling_overridden"]
        c["malformed_actions"] += episode.counts["malformed_tool_calls"]
        c["budget_refusals"] += int(episode.truncation is not None)
        c["tool_calls"] += len(tool_results)
        c["tool_errors"] += sum(not r.ok for r in tool_results)
        if chain is not None:
            c["untrained_policy_tokens"] += episode.capture.policy_tokens - chain.num_policy_tokens

    def stats(self, wall_s: float | None = None) -> dict[str, Any]:
        return {**self.counts, "router": self.router.stats(), "service": dict(self.service.counts),
                "tools": self.tools.stats() if self.tools is not None else {}}


def _is_status_error(err: BaseException) -> bool:
    return isinstance(getattr(err, "status_code", None), int)


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
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    transport = httpx.AsyncHTTPTransport(uds=str(server.socket_path), limits=limits) \
        if server.socket_path is not None else httpx.AsyncHTTPTransport(limits=limits)
    return factory(transport=transport, timeout=timeout, trust_env=False)


def agent_runner(cfg: Any, engine: Any, tokenizer: Any, *, tools: Any, envs: Any = None) -> Any:
    """The rollout side's runner: `GatewayRunner` when `task.agent` names an OpenAI-client agent, else the
    built-in `AgentRunner` (`hybridrl/agent/loop.py`)."""
    if cfg.task.agent:
        return GatewayRunner(engine, tokenizer, agent_cfg=cfg.agent, gateway_cfg=cfg.gateway, tools=tools,
                             run_id=cfg.run.name, agent=cfg.task.agent, seed=cfg.run.seed)
    from hybridrl.agent.loop import AgentRunner

    return AgentRunner(engine, tokenizer, agent_cfg=cfg.agent, tools=tools, run_id=cfg.run.name, seed=cfg.run.seed,
                       envs=envs)
