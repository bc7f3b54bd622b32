"""The gateway's HTTP side: a Starlette app on uvicorn, on the engine's event loop or in a thread of its own.

    POST /v1/chat/completions     (stream: server-sent events)
    POST /v1/completions
    GET  /v1/models

It listens on a Unix socket in a private directory (mode 0700, the socket 0600) or on a loopback TCP
address, nothing else. Every request needs an episode's key (`episodes.EpisodeKeys`). uvicorn is driven
by its `startup` / `shutdown` only: no signal handlers are installed (the rank's own stay in charge).

Where it runs (`HttpServer(own_thread=...)`, the run's `gateway.http_thread`): with `own_thread` uvicorn
serves on a loop of its own in a daemon thread ("hybridrl-gateway"), so the per-request CPU of HTTP, JSON,
the chat template and turn parsing never queues behind the engine's steps or the agents' coroutines on the
engine's loop, and the engine's loop never waits for it. The only thing a request needs of the engine's
loop is its generation: the service hands that over with `asyncio.run_coroutine_threadsafe`
(`service.on_loop`), and the answer comes back through the future. Without it (the default, measured faster
on CPU, where the two threads take turns on the interpreter lock) uvicorn serves on the loop that calls
`start`, the engine's. The engine's loop may stop between rollout phases and resume (nothing arrives then:
the agents run on it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from hybridrl.gateway.episodes import EpisodeKeys, GatewayError
from hybridrl.gateway.service import ClientGone, GatewayService, stream_chunks
from hybridrl.gateway.validate import check_request, parse_body

log = logging.getLogger(__name__)

CLIENT_LOST = "hybridrl.client_lost"     # the ASGI scope extension of the gateway's protocol (http_limits)
MISSING_STACK = ("the OpenAI-compatible gateway needs starlette and uvicorn (and agents need openai): "
                 "pip install -e .[gateway]")


def build_app(service: GatewayService, keys: EpisodeKeys, limits: Any = None) -> Any:
    """The Starlette app. `limits` (the gateway config) bounds a body's bytes and a request's text."""
    try:
        from starlette.applications import Starlette
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route
    except ImportError as err:
        raise ImportError(MISSING_STACK) from err
    max_body = (limits.max_body_kb if limits is not None else 4096) * 1024
    max_chars = limits.max_request_chars if limits is not None else 1 << 22

    def error(err: GatewayError) -> Response:
        service.counts["refused" if err.status < 500 else "errors"] += 1
        return Response(json.dumps(err.body()), status_code=err.status, media_type="application/json")

    async def body_of(request) -> tuple[dict[str, Any], int]:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_body):
            raise GatewayError(413, f"the request body is larger than gateway.max_body_kb={max_body // 1024}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_body:
                    raise GatewayError(413, f"the request body is larger than gateway.max_body_kb={max_body // 1024}")
                chunks.append(chunk)
        except ClientDisconnect:         # the client closed its upload, or the read deadline closed it
            raise ClientGone() from None
        return parse_body(b"".join(chunks)), size

    def endpoint(handler, *, chat: bool):
        async def serve(request) -> Response:
            service.counts["requests"] += 1
            try:
                episode = keys.find(request.headers)
                body, size = await body_of(request)
                check_request(body, chat=chat, max_chars=max_chars, body_bytes=size)
                out = await handler(episode, body, ClientWatch(request))
            except ClientGone as err:
                service.counts["client_closed"] += 1
                return error(err)
            except GatewayError as err:
                return error(err)
            except Exception as err:  # noqa: BLE001 - the gateway's own fault: a 500, the episode is invalid
                log.warning("gateway request failed: %s", err, exc_info=True)
                episode = _episode_or_none(keys, request)
                if episode is not None:
                    episode.end_reason = f"gateway error: {type(err).__name__}: {err}"
                    episode.infra_error = episode.end_reason
                return error(GatewayError(500, f"the gateway failed: {type(err).__name__}", type="server_error"))
            if body.get("stream"):
                service.counts["streamed"] += 1
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                events = stream_chunks(out, include_usage=include_usage) if out["object"] == "chat.completion" \
                    else _completion_events(out)

                async def send():
                    for event in events:
                        yield event
                return StreamingResponse(send(), media_type="text/event-stream")
            return Response(json.dumps(out), media_type="application/json")
        return serve

    async def models(request) -> Response:
        try:
            keys.find(request.headers)              # every endpoint needs a running episode's key
        except GatewayError as err:
            return error(err)
        return Response(json.dumps({"object": "list", "data": [{"id": service.model_name, "object": "model",
                                                                "created": 0, "owned_by": "hybridrl"}]}),
                        media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", endpoint(service.chat, chat=True), methods=["POST"]),
                             Route("/v1/completions", endpoint(service.completions, chat=False), methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])


class ClientWatch:
    """A request's client, for the service (`service.Gone`): whether it has gone, and a callback for when it
    goes (the body is read whole before the service runs, so nothing but `http.disconnect` is received)."""

    def __init__(self, request: Any):
        self.request = request
        # under the gateway's own protocol the connection keeps the record (`http_limits.ClientLost`)
        self.hooks = request.scope.get("extensions", {}).get(CLIENT_LOST)
        self._gone = False

    @property
    def gone(self) -> bool:
        return self._gone or (self.hooks is not None and self.hooks.lost)

    async def __call__(self) -> bool:
        """At once: an ASGI `receive()` returns without waiting when the server holds a message for the app
        (`http.disconnect` once the connection has closed); one that would wait is closed unawaited. Starlette's
        `is_disconnected` does the same through a cancelled anyio scope, at several times the cost a request.
        Under the gateway's own protocol the connection has already said so (`http_limits.ClientLost`)."""
        if self.hooks is None and not self._gone:
            pending = self.request.receive()
            try:
                pending.send(None)
            except StopIteration as answered:
                self._gone = answered.value["type"] == "http.disconnect"
            else:
                pending.close()
        return self.gone

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once the connection closes; returns what unregisters it. Under the gateway's own
        protocol the connection calls it (`http_limits.ClientLost`, no task per request); under another ASGI
        server a task waits for `http.disconnect`."""
        if self.hooks is not None:
            return self.hooks.add(callback)
        watch = asyncio.ensure_future(self.wait())
        watch.add_done_callback(lambda w: None if w.cancelled() else callback())
        return watch.cancel

    async def wait(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self._gone = True


def _episode_or_none(keys: EpisodeKeys, request) -> Any:
    try:
        return keys.find(request.headers)
    except GatewayError:
        return None


def _completion_events(out: dict[str, Any]) -> list[str]:
    events = ["data: " + json.dumps({**out, "choices": [c]}) + "\n\n" for c in out["choices"]]
    return events + ["data: [DONE]\n\n"]


class HttpServer:
    """uvicorn serving `app` on a socket made here (Unix in a private directory, or loopback TCP), in a
    thread of its own (`own_thread`) or on the loop that calls `start`."""

    def __init__(self, app: Any, *, listen: str = "unix", host: str = "127.0.0.1", port: int = 0,
                 own_thread: bool = False, limits: Any = None):
        self.app, self.listen, self.host, self.port = app, listen, host, port
        self.limits = limits                     # the gateway config: connection and keep-alive bounds
        self.own_thread = own_thread
        self.socket_path: Path | None = None
        self.loop: asyncio.AbstractEventLoop | None = None      # the loop uvicorn serves on
        self._thread: threading.Thread | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._sock: socket.socket | None = None
        self._server = None
        self.protocol: Any = None                # the HTTP protocol class (its read deadline, its counts)

    @property
    def base_url(self) -> str:
        """The URL an OpenAI client is given (over the Unix socket the host part is a placeholder)."""
        if self.listen == "unix":
            return "http://hybridrl-gateway/v1"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def start(self) -> None:
        try:
            import uvicorn
        except ImportError as err:
            raise ImportError(MISSING_STACK) from err
        self._sock = self._bind()
        if not self.own_thread:
            self.loop = asyncio.get_running_loop()
            await self._serve(uvicorn)
            return
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hybridrl-gateway", daemon=True)
        self._thread.start()
        try:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._serve(uvicorn), self.loop))
        except BaseException:
            self._stop_thread()
            raise

    async def _serve(self, uvicorn: Any) -> None:
        from hybridrl.gateway.http_limits import with_read_timeout

        limits = self.limits
        self.protocol = with_read_timeout(limits.read_timeout_s if limits is not None else 10.0)
        config = uvicorn.Config(self.app, http=self.protocol, lifespan="off", log_level="warning", access_log=False,
                                server_header=False, date_header=False,
                                timeout_keep_alive=limits.keep_alive_s if limits is not None else 30,
                                limit_concurrency=limits.max_connections if limits is not None else None,
                                h11_max_incomplete_event_size=64 * 1024)
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._sock])
        self._server = server

    def _bind(self) -> socket.socket:
        if self.listen == "unix":
            self._dir = tempfile.TemporaryDirectory(prefix="hybridrl-gateway-")
            os.chmod(self._dir.name, 0o700)
            self.socket_path = Path(self._dir.name) / "gateway.sock"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                sock.bind(str(self.socket_path))
            finally:
                os.umask(old)
            os.chmod(self.socket_path, 0o600)
        else:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1" if self.host == "localhost" else self.host, self.port))
            self.host, self.port = sock.getsockname()[:2]
        sock.listen(1024)
        sock.setblocking(False)
        return sock

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._server.shutdown(sockets=[self._sock])
            self._server = None

    async def stop(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive():
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop))
            self._stop_thread()
        else:
            await self._shutdown()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _stop_thread(self) -> None:
        """Stop the server's loop and thread (it has no work left by then: the join is immediate)."""
        loop, thread = self.loop, self._thread
        self._thread = None
        if thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        if not thread.is_alive():
            loop.close()
