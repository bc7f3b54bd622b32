"""What the gateway does with one request: OpenAI request body in, OpenAI response body out.

    check the episode's budgets -> render + capture the context (capture.py)
    -> [on the engine's loop] route (sticky replica) -> generate on the engine (per-token logprobs and
       versions; a turn interrupted by new weights or a pause continues on the newer version)
    -> parse the turn (toolcalls.py) -> commit the completion to the capture -> response

Two loops where `gateway.http_thread` is set: the HTTP side (everything here but generation) runs on
the server's loop (its own thread, `server.HttpServer`); generation runs on the loop of the episode's
engine (`GatewayEpisode.loop`, where the runner opened it), handed over whole, once per request, by
`on_loop` (on one loop, the default, a task of that loop). What both sides touch of an
episode is its counters and flags (single writes), and the close: a completion is committed under the
episode's lock, and the runner closes the episode under it, so a trajectory is never built from a
capture that is being extended.

Generation is the episode engine's turn core (`agent/episodes.py` `EpisodeEngine.generate_turn`, the same
the built-in loop uses): seeds, segments under new weights or after a pause, per-token versions and routing
records. A client that goes away before its completion is delivered commits nothing (and its generation is
aborted): an undelivered completion is never trained.

Sampling is the run's: the trainer recomputes logprobs at `agent.temperature` (the sampler contract),
so a request's own temperature / top_p are not applied; when they differ they are counted
(`sampling_overridden`). Penalties, logit bias and structured output are refused (the sampler contract
has none). Streaming sends the turn as server-sent events once its generation has ended (the engine
protocol returns whole outputs): a role chunk, the reasoning, the content, the tool calls, the finish
reason, usage when asked, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Sequence

from hybridrl.data.trajectory import ToolCallRecord, Truncation
from hybridrl.gateway.capture import Prepared, TemplateError
from hybridrl.gateway.episodes import BudgetExceeded, GatewayEpisode, GatewayError
from hybridrl.gateway.routing import Router
from hybridrl.gateway.toolcalls import ParsedTurn, TurnParser
from hybridrl.rollout.protocol import FinishReason

MAX_CHOICES = 16
_REFUSED = ("frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty")


@dataclass
class Generated:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str                      # stop | length | tool_calls
    routes: list = field(default_factory=list)     # each request's routing record (MoE engines), in order
    requests: list = field(default_factory=list)   # ((request id, sampling), engine output) per engine request


class ClientGone(GatewayError):
    """The client went away before its completion was delivered: nothing is committed."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request before its completion was delivered",
                         code="client_closed")


def on_loop(loop: asyncio.AbstractEventLoop | None, coro: Any) -> asyncio.Future:
    """`coro` run on `loop` (the engine's), as a future of the calling loop: a task when `loop` is this one,
    else the result of `run_coroutine_threadsafe` (the engine's loop wakes for it). Cancelling the future
    cancels the coroutine where it runs."""
    if loop is None or loop is asyncio.get_running_loop():
        return asyncio.ensure_future(coro)
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


class Gone(Protocol):
    """The client of one request: `await gone()` says whether it has gone away (at once); `gone.on_lost(cb)`
    calls `cb` once it goes (an event of the connection, never a clock) and returns what unregisters it."""

    def __call__(self) -> Awaitable[bool]: ...

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]: ...


class GatewayService:
    """`turns` is the episode engine that runs the gateway's episodes (`GatewayRunner`): its turn core
    generates every completion."""

    def __init__(self, template: Any, router: Router, parser: TurnParser, *, turns: Any, model_name: str,
                 render_tools: bool = True):
        self.template, self.router, self.parser = template, router, parser
        self.turns = turns
        self.render_tools = render_tools
        self.model_name = model_name
        self.counts = {"requests": 0, "refused": 0, "errors": 0, "streamed": 0, "client_closed": 0}

    # ------------------------------------------------------------------ /v1/chat/completions

    async def chat(self, episode: GatewayEpisode, body: dict[str, Any], gone: Gone | None = None) -> dict[str, Any]:
        episode.check_open()
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise GatewayError(400, "'messages' must be a list of messages", param="messages")
        _refuse_unsupported(body)
        tools = body.get("tools") or None
        names = tool_names(tools)
        choice = body.get("tool_choice", "auto")
        if choice == "none":
            names = []
        elif isinstance(choice, dict):
            names = [choice.get("function", {}).get("name")]
        options = body.get("chat_template_kwargs") or {}
        if not isinstance(options, dict):
            raise GatewayError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        try:
            prepared = episode.capture.prepare_chat(messages, tools=tools if self.render_tools else None,
                                                    options=options)
        except TemplateError as err:
            raise GatewayError(400, str(err), param="messages") from None
        response_id = f"chatcmpl-{_rid(episode)}"     # before the turn is counted: concurrent requests differ
        number = episode.turns
        results = await self._serve(episode, prepared, body, max_tokens=_max_tokens(body), gone=gone)
        _still_open(episode)
        turns = []
        for i, gen in enumerate(results):
            text = self.template.decode([t for t in gen.ids if t not in self.template.eos_ids])
            turns.append(self.parser.parse(_cut_stop(text, body.get("stop")), names,
                                           call_prefix=f"{episode.episode_id}/t{episode.turns}/{i}",
                                           action_formats=episode.task.action_formats))
        await _still_there(episode, gone)
        choices = []
        usage = 0
        with episode.lock:
            _still_open(episode)
            for i, (gen, turn) in enumerate(zip(results, turns)):
                message = turn.message()
                finish = "tool_calls" if turn.tool_calls and gen.finish == "stop" else gen.finish
                note = {"turn": number, "calls": len(turn.tool_calls), "malformed": turn.malformed, "finish": finish,
                        "requests": gen.requests}
                episode.capture.commit(prepared, gen.ids, gen.logprobs, gen.versions, returned=message,
                                       routes=gen.routes, text=turn.content or "", response_id=response_id, index=i,
                                       note=note)
                self._record(episode, turn)
                entry: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
                if body.get("logprobs"):
                    entry["logprobs"] = {"content": [self._token_logprob(t, lp)
                                                     for t, lp in zip(gen.ids, gen.logprobs)]}
                choices.append(entry)
                usage += len(gen.ids)
                episode.final_text = turn.content or ""
        return {"id": response_id, "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name, "choices": choices,
                "usage": _usage(prepared, usage), "system_fingerprint": f"hybridrl-v{max(results[0].versions, default=-1)}"}

    def _record(self, episode: GatewayEpisode, turn: ParsedTurn) -> None:
        episode.counts["malformed_tool_calls"] += turn.malformed
        for call in turn.tool_calls:
            episode.tool_calls.append(ToolCallRecord(turn=episode.turns - 1, name=call["function"]["name"], ok=True))
        for _ in range(turn.malformed):
            episode.tool_calls.append(ToolCallRecord(turn=episode.turns - 1, name="?", ok=False,
                                                     error="malformed: the tool call does not parse"))

    def _token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.template.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace")), "top_logprobs": []}

    # ------------------------------------------------------------------ /v1/completions

    async def completions(self, episode: GatewayEpisode, body: dict[str, Any],
                          gone: Gone | None = None) -> dict[str, Any]:
        episode.check_open()
        _refuse_unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
            raise GatewayError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                               param="prompt")
        if body.get("echo"):
            raise GatewayError(400, "'echo' is not served", param="echo")
        prepared = episode.capture.prepare_prompt(prompt)
        response_id = f"cmpl-{_rid(episode)}"
        number = episode.turns
        results = await self._serve(episode, prepared, body, max_tokens=_max_tokens(body, default=16), gone=gone)
        texts = [_cut_stop(self.template.decode([t for t in gen.ids if t not in self.template.eos_ids]),
                           body.get("stop")) for gen in results]
        await _still_there(episode, gone)
        choices, usage = [], 0
        with episode.lock:
            _still_open(episode)
            for i, (gen, text) in enumerate(zip(results, texts)):
                episode.capture.commit(prepared, gen.ids, gen.logprobs, gen.versions, routes=gen.routes, text=text,
                                       response_id=response_id, index=i,
                                       note={"turn": number, "calls": 0, "malformed": 0, "finish": gen.finish,
                                             "requests": gen.requests})
                entry: dict[str, Any] = {"index": i, "text": text, "finish_reason": gen.finish, "logprobs": None}
                if body.get("logprobs") is not None:
                    entry["logprobs"] = {"tokens": [self.template.decode([t]) for t in gen.ids],
                                         "token_logprobs": list(gen.logprobs), "top_logprobs": None,
                                         "text_offset": None}
                choices.append(entry)
                usage += len(gen.ids)
                episode.final_text = text
        return {"id": response_id, "object": "text_completion", "created": int(time.time()),
                "model": body.get("model") or self.model_name, "choices": choices, "usage": _usage(prepared, usage)}

    # ------------------------------------------------------------------ generation

    async def _serve(self, episode: GatewayEpisode, prepared: Prepared, body: dict[str, Any],
                     max_tokens: int | None, gone: Gone | None = None) -> list[Generated]:
        """Budgets of this request, then `n` completions of `prepared` on the episode's replica (aborted, and
        nothing kept, when the client goes away first)."""
        budgets = episode.budgets
        n = body.get("n") or 1
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
            raise GatewayError(400, f"'n' must be an integer in [1, {MAX_CHOICES}]", param="n")
        bounds = {Truncation.MAX_RESPONSE_TOKENS: budgets.max_response_tokens - prepared.response_tokens,
                  Truncation.CONTEXT: budgets.max_model_len - len(prepared.ids),
                  Truncation.MAX_NEW_TOKENS: budgets.max_new_tokens_per_turn}
        limit, room = min(bounds.items(), key=lambda kv: kv[1])
        if room < 1:
            episode.truncate(limit, f"the request's context leaves no room for a turn ({limit.value})")
            raise BudgetExceeded(limit, f"the episode's {limit.value} budget is spent: {len(prepared.ids)} context "
                                        f"tokens, {prepared.response_tokens} of them after the prompt")
        if max_tokens is not None and max_tokens < room:
            limit, room = None, max_tokens
        self._note_sampling(episode, body)
        stops = self._stop_ids(body.get("stop"))
        episode.turns += 1
        outs = await _unless_gone(on_loop(episode.loop, self._generate_all(episode, prepared.ids, room, stops,
                                                                            episode.turns - 1, n)), gone, episode)
        outs = [self._cut_at_stop(gen, body.get("stop")) for gen in outs]
        for gen in outs:
            if gen.finish == "length" and limit is not None and episode.truncation is None:
                if not (limit == Truncation.MAX_NEW_TOKENS and budgets.close_turn_at_limit):
                    episode.truncate(limit, f"a turn reached the {limit.value} budget")
        return list(outs)

    async def _generate_all(self, episode: GatewayEpisode, context: list[int], room: int, stops: tuple[int, ...],
                            turn: int, n: int) -> list[Generated]:
        """On the engine's loop: the episode's replica (placed at its first request), then `n` completions."""
        if episode.replica is None:
            episode.replica = self.router.place(episode.group_id)
        return list(await asyncio.gather(*[self._generate(episode, context, room, stops, turn, i) for i in range(n)]))

    async def _generate(self, episode: GatewayEpisode, context: list[int], room: int, stops: tuple[int, ...],
                        turn: int, choice: int) -> Generated:
        """One completion through the engine's turn core, as the gateway returns it."""
        replica = episode.replica
        replica.in_flight += 1
        replica.served += 1
        try:
            out = await self.turns.generate_turn(episode, replica.engine, context, room, turn=turn, choice=choice,
                                                 stops=stops)
        finally:
            replica.in_flight -= 1
        if out.segments:
            episode.sampler_contract = out.segments[-1].sampler_contract
        gen = Generated(out.ids, out.logprobs, out.versions, "length",
                        [s.routed_experts for s in out.segments if s.routed_experts is not None],
                        list(zip(out.requests, out.segments)))
        if out.cut == "deadline":                 # the wall clock ran out mid-request: keep what came back
            episode.truncate(Truncation.WALL_CLOCK, "the episode's wall-clock budget ran out mid-request")
            return gen
        if out.cut == "stop":
            raise GatewayError(503, "the run is stopping", type="server_error", code="stopped")
        if out.finish == FinishReason.STOP:
            gen.finish = "stop"
            return gen
        if out.finish in (FinishReason.LENGTH, FinishReason.CONTEXT):
            if out.finish == FinishReason.CONTEXT:
                episode.truncate(Truncation.CONTEXT, "the model's context length")
            return gen
        if episode.closed:
            raise GatewayError(410, "the episode has ended", code="episode_ended")
        episode.end_reason = f"the engine ended the request: {out.finish.value}"
        episode.aborted = True
        raise GatewayError(503, episode.end_reason, type="server_error", code="engine_aborted")

    def _cut_at_stop(self, gen: Generated, stop: Any) -> Generated:
        """A turn that contains a stop string of several tokens ends with the token that completes it (what
        the model generated after it is dropped); one-token stops were the engine's."""
        multi = [s for s in _stops(stop) if len(self.template.encode(s)) > 1]
        if not multi or not any(s in self.template.decode(gen.ids) for s in multi):
            return gen
        for k in range(1, len(gen.ids) + 1):
            if any(s in self.template.decode(gen.ids[:k]) for s in multi):
                return Generated(gen.ids[:k], gen.logprobs[:k], gen.versions[:k], "stop", gen.routes, gen.requests)
        return gen

    def _note_sampling(self, episode: GatewayEpisode, body: dict[str, Any]) -> None:
        for key, value in (("temperature", episode.temperature), ("top_p", episode.top_p)):
            asked = body.get(key)
            if asked is not None and float(asked) != float(value):
                episode.counts["sampling_overridden"] += 1
                return

    def _stop_ids(self, stop: Any) -> tuple[int, ...]:
        """Stop strings that are one token each stop the engine there; longer ones are cut afterwards."""
        out = []
        for s in _stops(stop):
            ids = self.template.encode(s)
            if len(ids) == 1:
                out.append(ids[0])
        return tuple(out)


async def _unless_gone(work: asyncio.Future, gone: Gone | None, episode: GatewayEpisode) -> Any:
    """`work`'s result, or ClientGone (`work` cancelled: its requests are aborted) when the client goes away
    first."""
    if gone is None:
        return await work
    # Cut by the connection's own disconnect event, not polled on a timer: a poll's wake-ups would decide, by
    # the clock, on which turn of the loop the answer goes back and so when the agent's next request reaches
    # the engine (which requests share a batch). The answer goes back on the turn the work finishes.
    lost = []

    def cut() -> None:
        lost.append(True)
        work.cancel()

    forget = gone.on_lost(cut)
    try:
        return await work
    except asyncio.CancelledError:
        if not lost:                                         # this request itself was cancelled
            raise
    finally:
        forget()
    episode.counts["disconnected"] += 1
    raise ClientGone()


async def _still_there(episode: GatewayEpisode, gone: Gone | None) -> None:
    """Refuse to commit a completion whose client has gone away (it was never delivered)."""
    if gone is not None and await gone():
        episode.counts["disconnected"] += 1
        raise ClientGone()


def _still_open(episode: GatewayEpisode) -> None:
    """A completion that comes back after its episode ended is not recorded (the trajectory is built)."""
    if episode.closed:
        raise GatewayError(410, "the episode has ended", code="episode_ended")


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise GatewayError(400, "'stop' must be a non-empty string or a list of up to 4", param="stop")
    return stops


def _cut_stop(text: str, stop: Any) -> str:
    """The text before the first stop string (the stop string itself is not returned)."""
    cut = len(text)
    for s in _stops(stop):
        at = text.find(s)
        if 0 <= at < cut:
            cut = at
    return text[:cut]


def _max_tokens(body: dict[str, Any], default: int | None = None) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens", default))
    if value is None:
        return None
    if not isinstance(value, int) or value < 1:
        raise GatewayError(400, "'max_tokens' must be a positive integer", param="max_tokens")
    return value


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key in _REFUSED:
        if body.get(key):
            raise GatewayError(400, f"'{key}' is not served: the sampler contract has no penalties or biases "
                                    "(the trainer could not recompute those logprobs)", param=key)
    if body.get("top_logprobs"):
        raise GatewayError(400, "'top_logprobs' is not served: the engine returns the sampled token's logprob "
                                "only (use logprobs=true)", param="top_logprobs")
    fmt = body.get("response_format")
    if fmt and fmt.get("type") not in (None, "text"):
        raise GatewayError(400, "'response_format' other than text is not served (no grammar-constrained "
                                "sampling in the sampler contract)", param="response_format")


def _usage(prepared: Prepared, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": len(prepared.ids), "completion_tokens": completion_tokens,
            "total_tokens": len(prepared.ids) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": prepared.reused_tokens}}


def _rid(episode: GatewayEpisode) -> str:
    """The id of the request about to be counted (its turn number: unique within the episode, even for
    requests in flight at once; `Outcome.completion` names a completion by it). A digest of the episode id,
    not `hash()`: the same id in every process and rerun (the interpreter salts string hashes)."""
    digest = int(hashlib.blake2b(episode.episode_id.encode(), digest_size=8).hexdigest(), 16)
    return f"{digest % 10**12:012d}-{episode.turns + 1}"


def stream_chunks(response: dict[str, Any], *, include_usage: bool) -> list[str]:
    """A chat completion as the server-sent events of a stream (each `data: ...\\n\\n`)."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"], "system_fingerprint": response.get("system_fingerprint")}
    events = []

    def emit(choices: list, **extra: Any) -> None:
        events.append("data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n")

    for choice in response["choices"]:
        i, message = choice["index"], choice["message"]
        emit([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        if message.get("reasoning_content"):
            emit([{"index": i, "delta": {"reasoning_content": message["reasoning_content"]}, "finish_reason": None}])
        if message.get("content"):
            emit([{"index": i, "delta": {"content": message["content"]}, "finish_reason": None,
                   "logprobs": choice.get("logprobs")}])
        if message.get("tool_calls"):
            emit([{"index": i, "delta": {"tool_calls": [{"index": k, **call}
                                                        for k, call in enumerate(message["tool_calls"])]},
                   "finish_reason": None}])
        emit([{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}])
    if include_usage:
        emit([], usage=response["usage"])
    events.append("data: [DONE]\n\n")
    return events


def tool_names(tools: Sequence[dict] | None) -> list[str]:
    return [t.get("function", {}).get("name") for t in tools or () if isinstance(t, dict)]
