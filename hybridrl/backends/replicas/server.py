"""`hybridrl replica`: one native engine behind HTTP, a process of its own outside the training ranks'
process group. The trainer's `ReplicasEngine` is its client.

    hybridrl replica --model HF_DIR [--port P] [--registry RUN_DIR/replicas] [--config RECIPE] [rollout.native.k=v]

    GET  /info       who it is (an id of this process), the version it serves, its weight spec, counts
    POST /generate   token ids, sampling parameters, request id (and the tokens a lost replica generated
                     for it, to go on from) -> a GenerationOutput (wire.py); with "stream": JSON lines of
                     the tokens generated so far while it runs, then the output
    POST /abort      a request id -> whether it was running
    POST /weights    one bucket (safetensors bytes, the version and digests in its metadata): copied into the
                     engine and read back there; 409 names the tensors that differ
    GET  /stats      the engine's counters

Once it listens it registers: one JSON file (`<id>.json`: its URL, pid, model) in the registry directory,
removed when it exits cleanly (a killed replica leaves it; the client then finds nobody at that URL). It
serves the model directory's weights as loaded, but the client sends it no request before it received a
whole version from the trainer: a replica joins at the trainer's next publication.

The HTTP stack is the gateway's (Starlette on uvicorn), on the engine's event loop: the native engine's loop
driver runs its steps there between requests. Import-light (the CLI builds its parser from `add_arguments`):
torch comes with the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

log = logging.getLogger("hybridrl.replica")

EXIT_USAGE = 2
STREAM_EVERY_S = 0.05       # how often a streamed request reports the tokens it generated since


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory: the run's model.path")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free one; the registration says which)")
    parser.add_argument("--registry", default=None, help="directory to register in (the run's "
                                                         "rollout.replicas.registry, by default RUN_DIR/replicas)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--config", default=None, help="recipe YAML whose rollout.native section configures the engine")
    parser.add_argument("--kill-at-request", type=int, default=0, metavar="N",
                        help="fault injection: SIGKILL this replica when its N-th generation request arrives (tests)")
    parser.add_argument("--kill-after-tokens", type=int, default=0, metavar="T",
                        help="with --kill-at-request N: SIGKILL it once a request from the N-th on has streamed "
                             "T tokens back, not at the N-th's arrival (tests)")
    parser.add_argument("overrides", nargs="*", help="rollout.native.key=value")


class ReplicaServer:
    """The routes over one engine."""

    def __init__(self, engine: Any, *, instance: str, kill_at_request: int = 0, kill_after_tokens: int = 0):
        self.engine, self.instance = engine, instance
        self.kill_at_request, self.kill_after_tokens = kill_at_request, kill_after_tokens
        self.requests = 0            # generation requests that arrived
        self.served = 0              # and were answered
        self.versions_served: dict[int, int] = {}     # policy version -> requests answered on it
        self.received: int | None = None              # the last version it holds whole from the trainer
        self.publisher = ""                           # the client that sent the last bucket
        self.weight_bytes = 0                         # bytes of weight buckets received (cumulative)

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {"instance": self.instance, "pid": os.getpid(), "policy_version": engine.policy_version,
                "eos_token_ids": list(engine.eos_token_ids), "max_model_len": engine.max_model_len,
                "vocab_size": engine.vocab_size, "seed": engine.config.seed, "served": self.served,
                "weight_bytes": self.weight_bytes,
                "versions_served": {str(k): v for k, v in sorted(self.versions_served.items())},
                "weight_spec": {n: [list(shape), str(dtype).replace("torch.", "")]
                                for n, (shape, dtype) in engine.weight_spec().items()}}

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        from hybridrl.backends.replicas import wire

        self._arrived(body)
        return wire.output_to_json(await self._generate(body))

    async def generate_stream(self, body: dict[str, Any]) -> AsyncIterator[str]:
        """The request's answer as JSON lines: {"saved": ...} while it runs (the tokens since the last line with
        their logprobs and versions; the newest token is held back, as it may end the request), then
        {"output": ...}, or {"error": ..., "status": ...}. What a client saw saved survives this process:
        another replica goes on from it (`generate(generated=...)`)."""
        from hybridrl.backends.replicas import wire

        number = self._arrived(body)
        # the first request from the N-th on to stream T tokens (one that ends sooner spares it)
        doomed = self.kill_after_tokens > 0 and number >= self.kill_at_request > 0
        task = asyncio.ensure_future(self._generate(body))
        sent = len((body.get("resume") or {}).get("token_ids", ()))      # what the client holds already
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.0 if doomed else STREAM_EVERY_S)   # doomed: every step
                progress = None if task.done() else self.engine.progress(body["request_id"], sent)
                if progress is None or len(progress[0]) <= 1:
                    continue
                ids, logprobs, version, starts = progress
                yield _line({"saved": {"start": sent, "token_ids": ids[:-1], "logprobs": logprobs[:-1],
                                       "policy_version": version, "version_starts": [list(v) for v in starts]}})
                sent += len(ids) - 1
                if doomed and sent >= self.kill_after_tokens:
                    await asyncio.sleep(0.1)            # the line on its way before the process goes
                    self._die(f"request {number} ({body['request_id']}) streamed {sent} tokens")
            yield _line({"output": wire.output_to_json(task.result())})
        except (ValueError, KeyError, TypeError) as err:
            yield _line({"error": f"{type(err).__name__}: {err}", "status": 400})
        except Exception as err:  # noqa: BLE001 - the client hears why; the replica serves on
            log.exception("replica %s: /generate failed", self.instance)
            yield _line({"error": f"{type(err).__name__}: {err}", "status": 500})
        finally:
            if not task.done():                         # the client went away: the request ends with it
                task.cancel()

    def _arrived(self, body: dict[str, Any]) -> int:
        """Count a generation request; the fault injection's kill at arrival. Returns its number."""
        self.requests += 1
        if self.requests == self.kill_at_request and not self.kill_after_tokens:
            self._die(f"request {self.requests} ({body.get('request_id')}) arrived")
        return self.requests

    def _die(self, when: str) -> None:
        log.warning("replica %s: %s: killing myself (--kill-at-request)", self.instance, when)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    async def _generate(self, body: dict[str, Any]) -> Any:
        from hybridrl.backends.replicas import wire

        resume = body.get("resume") or {}
        out = await self.engine.generate(body["token_ids"], wire.sampling_from_json(body["sampling"]),
                                         body["request_id"],
                                         generated=(resume.get("token_ids", ()), resume.get("logprobs", ())))
        self.served += 1
        self.versions_served[out.policy_version] = self.versions_served.get(out.policy_version, 0) + 1
        return out

    async def weights(self, payload: bytes) -> dict[str, Any]:
        from hybridrl.backends.replicas import wire

        named, version, digests, client = wire.read_weights(payload)
        self.weight_bytes += len(payload)
        await self._new_trainer(client, version)
        await self.engine.update_weights(named, version, digests=digests)
        whole = self.engine.policy_version == version and self.engine.stats()["pending_version"] is None
        if whole and self.received != version:
            self.received = version
            log.info("replica %s: received policy version %d from the trainer, serving it", self.instance, version)
        return {"instance": self.instance, "policy_version": self.engine.policy_version}

    async def _new_trainer(self, client: str, version: int) -> None:
        """A version older than the one held, from another client than the last publisher: a trainer started
        again (resumed from an earlier checkpoint) while this replica lived on. Its versions count from there:
        the engine forgets its version (it serves nothing until that whole version arrived)."""
        stats = self.engine.stats()
        held = max(stats["policy_version"], stats["pending_version"] if stats["pending_version"] is not None else -1)
        if client != self.publisher and version < held:
            log.info("replica %s: a new trainer publishes v%d, older than the v%d held: its versions count from there",
                     self.instance, version, held)
            await self.engine.run_in_engine(_forget_version)
        self.publisher = client

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route

        from hybridrl.rollout.weight_spec import WeightMismatch

        async def guarded(handler, request: Request) -> Response:
            try:
                answer = await handler(request)
                return answer if isinstance(answer, Response) else JSONResponse(answer)
            except WeightMismatch as err:
                return JSONResponse({"error": str(err), "mismatch": err.names}, status_code=409)
            except (ValueError, KeyError, TypeError) as err:
                return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=400)
            except Exception as err:  # noqa: BLE001 - the client hears why; the replica serves on
                log.exception("replica %s: %s failed", self.instance, request.url.path)
                return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=500)

        async def info(request: Request) -> dict:
            return self.info()

        async def generate(request: Request) -> Any:
            body = await request.json()
            if body.get("stream"):
                return StreamingResponse(self.generate_stream(body), media_type="application/x-ndjson")
            return await self.generate(body)

        async def abort(request: Request) -> dict:
            return {"found": await self.engine.abort((await request.json())["request_id"])}

        async def weights(request: Request) -> dict:
            return await self.weights(await request.body())

        async def stats(request: Request) -> dict:
            return {k: v for k, v in self.engine.stats().items() if k != "latency"}

        def route(path: str, handler, method: str) -> Route:
            async def endpoint(request: Request) -> Response:
                return await guarded(handler, request)
            return Route(path, endpoint, methods=[method])

        return Starlette(routes=[route("/info", info, "GET"), route("/generate", generate, "POST"),
                                 route("/abort", abort, "POST"), route("/weights", weights, "POST"),
                                 route("/stats", stats, "GET")])


def _line(message: dict[str, Any]) -> str:
    return json.dumps(message) + "\n"


def _forget_version(core: Any) -> None:
    core.publication.forget()


def register(registry: Path, instance: str, url: str, model: str) -> Path:
    """Write this replica's registration (atomically: a reader never sees half a file)."""
    registry.mkdir(parents=True, exist_ok=True)
    path = registry / f"{instance}.json"
    tmp = registry / f".{instance}.json.tmp"
    tmp.write_text(json.dumps({"instance": instance, "url": url, "pid": os.getpid(), "model": model}))
    os.replace(tmp, path)
    return path


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(server: ReplicaServer, *, host: str, port: int, registry: Path | None, model: str) -> None:
    """Listen, register, serve until SIGTERM / SIGINT, then unregister."""
    import uvicorn

    sock = _bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
    config = uvicorn.Config(server.app(), lifespan="off", log_level="warning", access_log=False,
                            server_header=False, date_header=False, timeout_keep_alive=300)
    config.load()
    http = uvicorn.Server(config)
    http.lifespan = config.lifespan_class(config)          # what `serve` would set (its signal handlers are not)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(http, "should_exit", True))
    await http.startup(sockets=[sock])
    path = register(registry, server.instance, url, model) if registry is not None else None
    log.info("replica %s: listening on %s%s", server.instance, url, f" (registered in {path})" if path else "")
    try:
        await http.main_loop()
    finally:
        if path is not None:
            path.unlink(missing_ok=True)
        await http.shutdown(sockets=[sock])
        sock.close()


def main(args: argparse.Namespace) -> int:
    from hybridrl.config import ConfigError, load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(args.config, args.overrides).rollout.native
    except ConfigError as err:
        print(f"hybridrl replica: {err}", file=sys.stderr)
        return EXIT_USAGE
    from hybridrl.backends.native import NativeEngine

    instance = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    engine = NativeEngine.from_pretrained(args.model, cfg, device=args.device)
    server = ReplicaServer(engine, instance=instance, kill_at_request=args.kill_at_request,
                           kill_after_tokens=args.kill_after_tokens)
    try:
        asyncio.run(serve(server, host=args.host, port=args.port, model=str(args.model),
                          registry=Path(args.registry) if args.registry else None))
    finally:
        engine.close()
    return 0
