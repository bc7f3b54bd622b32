"""Allow-listed egress for tools (`tools.network: allowlist`): the only way out of a sandbox is an
HTTP CONNECT proxy the pool runs outside it, which opens a connection only to a destination the
config declares (`tools.allowed_destinations`), and logs every attempt.

Inside, the sandbox's network namespace has a loopback device and nothing else, and the only
listener on it is pid 1's socket at 127.0.0.1:3128, which the pool accepts on (boot.py,
`open_egress`). The tool's environment names it (`HTTPS_PROXY`, `HTTP_PROXY`, `ALL_PROXY`), so
clients that tunnel through a proxy (urllib for https, `http.client.HTTPConnection.set_tunnel`,
curl, pip, requests) work unchanged; any other address is unreachable (no route), and the
syscall filter refuses other socket families.

The proxy speaks only CONNECT: `CONNECT host:port HTTP/1.1` for a declared `host:port`, or
`CONNECT unix:/path HTTP/1.1` for a declared unix socket `unix:/path`; a name is matched as
written (lower case), an address literally (IPv6 in brackets: `[::1]:8080`). Anything else is
answered 403 (not declared) or 405 (not CONNECT). Every attempt is one audit record with the
episode and tool call it came from, the destination (cut to `TARGET_CHARS`, its length noted), the
verdict and the bytes each way.

What a sandbox can cost the pool is bounded: a request head over `_HEAD_LIMIT` bytes is refused
(431) without reading on (the stream's buffer is that limit), and one sandbox holds at most
`max_connections` connections at once (`tools.egress_max_connections`): more are closed as soon as
accepted and counted (`counts["over_cap"]`, one audit record per sandbox call), so a tool cannot
exhaust the trainer's descriptors.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import time
from typing import Any

from hybridrl.telemetry.audit import clip

log = logging.getLogger(__name__)

PROXY_PORT = 3128                # boot.py's listener inside the sandbox
_HEAD_LIMIT = 8192               # bytes of a request head (and the stream reader's buffer)
TARGET_CHARS = 300               # of a logged destination
_HEAD_TIMEOUT_S = 10.0
_CONNECT_TIMEOUT_S = 10.0
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}


def parse_destination(entry: str) -> str:
    """The canonical form of a declared destination: "host:port" (lower case, IPv6 in brackets)
    or "unix:/absolute/path"; ValueError naming the problem otherwise."""
    entry = entry.strip()
    if entry.startswith("unix:"):
        path = entry[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError(f"{entry!r}: a unix socket destination is unix:/absolute/path")
        return "unix:" + path
    host, sep, port = entry.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r}: expected host:port (port 1-65535), [ipv6]:port or unix:/path")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"{entry!r}: write an IPv6 address in brackets, e.g. [::1]:{port}")
    return f"{host.lower()}:{int(port)}"


class Serving:
    """The proxy serving one sandbox: `close()` (when the sandbox ends) stops accepting and ends
    every connection still open, each with its audit record."""

    def __init__(self, proxy: "EgressProxy", call: dict[str, Any]) -> None:
        self.proxy, self.call = proxy, call
        self.accepter: asyncio.Task | None = None
        self.tasks: set[asyncio.Task] = set()
        self.over_cap = 0                         # connections closed at once: the sandbox held too many

    def close(self) -> None:
        if self.accepter is not None:            # it closes the listener once its accept is withdrawn
            self.accepter.cancel()
        for task in list(self.tasks):
            task.cancel()
        if self.over_cap:
            self.proxy.record(self.call, destination="?", verdict="refused: over the connection cap",
                              connections=self.over_cap, bytes_out=0, bytes_in=0, seconds=0.0)
            self.over_cap = 0


class EgressProxy:
    """One per pool; `serve(listener, call)` per sandbox run (the listener came from its pid 1)."""

    def __init__(self, allowed: list[str], audit: Any = None, *, max_connections: int = 16):
        self.allowed = {parse_destination(d) for d in allowed}
        self.audit = audit
        self.max_connections = max_connections
        self.counts = {"allowed": 0, "refused": 0, "over_cap": 0}

    async def serve(self, listener: socket.socket, call: dict[str, Any]) -> Serving:
        listener.setblocking(False)
        serving = Serving(self, call)
        serving.accepter = asyncio.ensure_future(self._accept(listener, serving))
        return serving

    def record(self, call: dict[str, Any], **fields: Any) -> None:
        if self.audit is not None:               # never raises: a failed write is counted by the log
            self.audit.record("egress", episode=call.get("episode"), call=call.get("call"), **fields)

    async def _accept(self, listener: socket.socket, serving: Serving) -> None:
        """Accept one connection at a time (asyncio's servers accept a whole backlog at once, each a
        descriptor of ours until its handler runs): past the sandbox's cap, closed at once and
        counted. The pool then holds at most `max_connections` (+1) of a sandbox's connections."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(listener)
                except OSError as err:
                    if err.errno not in _TRANSIENT:
                        log.warning("egress proxy: accepting stopped: %s", err)
                        return
                    log.warning("egress proxy: accept failed (retrying): %s", err)
                    await asyncio.sleep(0.1)      # out of descriptors or memory: later, not never
                    continue
                if len(serving.tasks) >= self.max_connections:
                    serving.over_cap += 1
                    self.counts["over_cap"] += 1
                    conn.close()
                    continue
                try:
                    reader, writer = await asyncio.open_connection(sock=conn, limit=_HEAD_LIMIT)
                except OSError:
                    conn.close()
                    continue
                task = asyncio.ensure_future(self._handle(reader, writer, serving.call, serving))
                serving.tasks.add(task)           # counted from now, not from when it first runs
                # a task cancelled before it first ran never reaches its `finally`: close here too
                task.add_done_callback(functools.partial(_close_quietly, writer))
        finally:
            listener.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      call: dict[str, Any], serving: Serving) -> None:
        task = asyncio.current_task()
        serving.tasks.add(task)
        started = time.monotonic()
        target, verdict, up, down = "?", "refused", 0, 0
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT_S)
            except asyncio.LimitOverrunError:
                verdict = f"refused: request head over {_HEAD_LIMIT} bytes"
                await _reply(writer, 431, "Request Header Fields Too Large")
                return
            except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                verdict = "refused: no complete request head"
                return
            request = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request.split()
            if len(parts) != 3 or parts[0].upper() != "CONNECT":
                target = parts[1] if len(parts) > 1 else "?"
                verdict = "refused: only CONNECT is proxied"
                await _reply(writer, 405, "Method Not Allowed")
                return
            target = parts[1]
            try:
                canonical = parse_destination(target)
            except ValueError:
                canonical = None
            if canonical is None or canonical not in self.allowed:
                verdict = "refused: not an allowed destination"
                await _reply(writer, 403, "Forbidden")
                return
            try:
                upstream_r, upstream_w = await asyncio.wait_for(_open(canonical), _CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError) as err:
                verdict = f"failed: {type(err).__name__}: {err}"
                await _reply(writer, 502, "Bad Gateway")
                return
            verdict = "allowed"
            await _reply(writer, 200, "Connection established")
            up, down = await _relay(reader, writer, upstream_r, upstream_w)
        except (ConnectionError, OSError) as err:
            if verdict == "refused":
                verdict = f"refused: {type(err).__name__}"
        except asyncio.CancelledError:           # the sandbox ended: its connections end with it
            if verdict == "refused":
                verdict = "refused: the sandbox ended"
        finally:
            serving.tasks.discard(task)
            self.counts["allowed" if verdict == "allowed" else "refused"] += 1
            writer.close()
            self.record(call, destination=clip(target, TARGET_CHARS), verdict=clip(verdict, TARGET_CHARS),
                        bytes_out=up, bytes_in=down, seconds=round(time.monotonic() - started, 4))


def _close_quietly(writer: asyncio.StreamWriter, _task: asyncio.Task | None = None) -> None:
    try:
        writer.close()
    except RuntimeError:                          # the loop is closed: the transport went with it
        pass


async def _reply(writer: asyncio.StreamWriter, code: int, reason: str) -> None:
    writer.write(f"HTTP/1.1 {code} {reason}\r\nContent-Length: 0\r\n\r\n".encode())
    try:
        await writer.drain()
    except ConnectionError:
        pass


async def _open(destination: str):
    if destination.startswith("unix:"):
        return await asyncio.open_unix_connection(destination[len("unix:"):])
    host, _, port = destination.rpartition(":")
    return await asyncio.open_connection(host.strip("[]"), int(port))


async def _relay(client_r, client_w, upstream_r, upstream_w) -> tuple[int, int]:
    """Copy both ways until either side closes; (bytes to the destination, bytes back)."""
    counts = [0, 0]

    async def pump(src, dst, i):
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                counts[i] += len(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                dst.write_eof()
            except (OSError, RuntimeError, AttributeError):
                pass

    try:
        await asyncio.gather(pump(client_r, upstream_w, 0), pump(upstream_r, client_w, 1))
    except asyncio.CancelledError:
        pass                                      # counted so far: the caller records them
    finally:
        upstream_w.close()
    return counts[0], counts[1]
