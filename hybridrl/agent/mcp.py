"""MCP tool servers (`tools.mcp`; `pip install -e .[mcp]`): a server's tools offered to the model as hybridrl tools.

    tools:
      mcp:
        - name: arith                                        # its tools are arith_add, arith_multiply, ...
          command: [python, recipes/envs/mcp_arith_server.py]   # a stdio MCP server (python: the tools' interpreter)
          timeout_s: 10                                      # one call
        - {name: notes, url: "http://127.0.0.1:8765/mcp"}   # or a server already running, on loopback (HTTP)
    task:
      options: {tools: [arith_add, arith_multiply]}         # instances name the tools they may call

Each server runs INSIDE the tool sandbox (`SandboxPool.start_server`): the isolation, syscall filter, limits,
egress policy and audit of a python tool call, in a sandbox of its own that lives as long as the server (a
slot reserved for it; `memory_mb` its own). Its root holds the system paths of every sandbox plus, read-only,
the files its command names, this interpreter's site-packages (where `mcp` / `fastmcp` are) and
`visible_paths`. Its stdin and stdout are the MCP stdio transport (newline-delimited JSON-RPC), spoken by the
`mcp` package's own `ClientSession`. A server named by `url` instead is one already running on this
machine's loopback (anything else is refused when the config loads), reached over MCP's streamable HTTP
transport; it is the user's process, which hybridrl neither starts nor sandboxes. Either way the session runs
`initialize`, `list_tools` (each tool's name, description and input schema become a `ToolSpec`: the OpenAI
tool schema the model is shown, and the arguments the agent loop checks) and `call_tool`. A server's tool
`add` is the hybridrl tool `arith_add` (server name, `_`, tool name); an instance names the ones it may call,
and a named tool the server does not list is an error at start.

A call is the model's to lose, never the infrastructure's: a call that runs past `timeout_s`, a server that
floods stdout (a line over `tools.max_output_bytes`) or dies, is a tool error the model sees (`ok=False`), and
the server is restarted (in a fresh sandbox) for the next call. A server that cannot be started again is an
infrastructure error (the episode is never trained on). What the server writes to stderr is kept within the
sandbox's output budget and discarded. A `url` server that fails a call is reconnected (a new session) for the
next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import shlex
import site
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any

from hybridrl.agent.actions import ToolSpec
from hybridrl.agent.sandbox.pool import SANDBOX_WORKDIR
from hybridrl.agent.tools.base import ToolResult
from hybridrl.config.fields import ConfigValueError
from hybridrl.envs.config import check_loopback_url

log = logging.getLogger(__name__)

INSTALL = "pip install -e .[mcp]   (or pip install mcp fastmcp)"
NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]{0,31}$")      # no "_": a tool name splits at its first one


@dataclass(kw_only=True)
class McpServerConfig:
    name: str
    command: list[str] = field(default_factory=list)     # a stdio server, started in the sandbox
    url: str = ""                      # or a streamable HTTP server already running on loopback
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 10.0            # one call
    start_timeout_s: float = 60.0      # start, initialize, list the tools
    memory_mb: int = 1024              # the server's sandbox (its cgroup and address space)
    visible_paths: list[str] = field(default_factory=list)   # more host paths bound read-only


def check_servers(entries: list[Any]) -> list[dict[str, Any]]:
    """`tools.mcp` checked (names, a command or a loopback url, numbers, the package installed);
    ConfigValueError naming the key."""
    out, names = [], set()
    known = {f.name for f in dataclasses.fields(McpServerConfig)}
    for i, entry in enumerate(entries):
        key = f"mcp[{i}]"
        if not isinstance(entry, dict) or set(entry) - known or "name" not in entry:
            raise ConfigValueError(key, f"must be {{name, command | url, env, timeout_s, start_timeout_s, memory_mb, "
                                        f"visible_paths}} with a name, got {entry!r}")
        command = entry.get("command") or []
        command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        server = McpServerConfig(**{**entry, "command": command, "url": str(entry.get("url") or ""),
                                    "env": {str(k): str(v) for k, v in dict(entry.get("env") or {}).items()}})
        if not NAME.match(str(server.name)) or server.name in names:
            raise ConfigValueError(f"{key}.name", f"{server.name!r}: a distinct name of letters, digits and '-' "
                                                  "(no '_': the tools are NAME_TOOL)")
        if command and server.url:
            raise ConfigValueError(key, "give a command (a stdio server hybridrl starts in the sandbox) or a url "
                                        "(a streamable HTTP server running on loopback), not both")
        if not (command or server.url):
            raise ConfigValueError(f"{key}.command", "the server's command line, e.g. [python, my_server.py] (or "
                                                     "url: the address of one running on loopback)")
        if server.url:
            check_loopback_url(f"{key}.url", server.url, ("http", "https"))
        for knob_name in ("timeout_s", "start_timeout_s", "memory_mb"):
            if not float(getattr(server, knob_name)) > 0:
                raise ConfigValueError(f"{key}.{knob_name}", f"must be > 0, got {getattr(server, knob_name)}")
        names.add(server.name)
        out.append(dataclasses.asdict(server))
    try:
        import mcp  # noqa: F401
    except ImportError as err:
        raise ConfigValueError("mcp", f"MCP tool servers need the mcp package ({err}): {INSTALL}") from None
    return out


def server_of(cfg: Any, tool: str) -> tuple[dict[str, Any], str] | None:
    """(the `tools.mcp` entry, the server's own tool name) of the hybridrl tool `tool`, or None."""
    prefix, sep, own = tool.partition("_")
    for server in cfg.mcp if cfg is not None else ():
        if sep and server["name"] == prefix and own:
            return server, own
    return None


# temporary directories a server's files may not live in: inside the sandbox /tmp is the tool's own tmpfs
# (SANDBOX_WORKDIR) and /dev a minimal one of its own, so files there are not seen; /var/tmp is refused alike
SANDBOX_OWN_TEMP = (f"{SANDBOX_WORKDIR}/", "/var/tmp/", "/dev/shm/")


def launch(server: McpServerConfig, python: str) -> tuple[list[str], dict[str, str], list[str]]:
    """(argv, environment, paths to bind read-only) of a server: `python` is the tools' interpreter, files of
    the command are made absolute and visible, and this interpreter's site-packages are on PYTHONPATH."""
    argv = [python if c == "python" else c for c in server.command]
    for c in argv[1:]:
        if os.path.exists(c) and os.path.abspath(c).startswith(SANDBOX_OWN_TEMP):
            raise ValueError(f"MCP server {server.name!r}: {c} is under a temporary directory, which the sandbox "
                             "replaces with its own: put the server's files elsewhere")
    argv = [os.path.abspath(c) if os.path.exists(c) and c != python else c for c in argv]
    packages = [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p)]
    files = [os.path.dirname(c) if os.path.isfile(c) else c for c in argv[1:] if os.path.exists(c)]
    path = os.pathsep.join(dict.fromkeys([*files, *packages]))
    env = {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **server.env}
    return argv, env, sorted({*files, *packages, *map(os.path.abspath, server.visible_paths)})


def content_text(result: Any) -> str:
    """A `CallToolResult`'s content as the text the model reads."""
    parts = [c.text if c.type == "text" else f"[{c.type} content]" for c in result.content]
    if not parts and result.structured_content is not None:
        parts.append(str(result.structured_content))
    return "\n".join(parts)


class McpServer:
    """One configured server: started in its sandbox on first use, restarted after it fails a call."""

    def __init__(self, cfg: McpServerConfig, pool: Any):
        self.cfg, self.pool = cfg, pool
        self.tools: dict[str, Any] = {}              # the server's name -> its mcp Tool
        self.session: Any = None
        self.sbx: Any = None
        self.generation = 0                          # one per start: a failure restarts the generation it saw
        self.counts = {"starts": 0, "calls": 0, "timeouts": 0, "floods": 0, "deaths": 0}
        self._owner: asyncio.Task | None = None
        self._stop: asyncio.Event | None = None
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Start it (the sandbox, `initialize`, `list_tools`) within `start_timeout_s`; raises when it cannot."""
        loop = asyncio.get_running_loop()
        ready, self._stop = loop.create_future(), asyncio.Event()
        self._owner = asyncio.ensure_future(self._own(ready, self._stop))
        try:
            await asyncio.wait_for(asyncio.shield(ready), self.cfg.start_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self.generation += 1
        self.counts["starts"] += 1

    async def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
        if self._owner is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._owner), 15.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - ending it is all that is left
                self._owner.cancel()
        self._owner, self.session = None, None

    async def _own(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """The task that holds the session's context (the mcp package's task group lives in one task)."""
        from mcp import ClientSession

        try:
            async with self._transport() as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                self.tools = {t.name: t for t in (await session.list_tools()).tools}
                self.session = session
                ready.set_result(None)
                await stop.wait()
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the start
            if not ready.done():
                ready.set_exception(RuntimeError(self._start_failure(err)))
        finally:
            self.session = None

    @contextlib.asynccontextmanager
    async def _transport(self) -> AsyncIterator[tuple[Any, Any]]:
        """The session's (read, write) streams: a streamable HTTP connection to `url`, or the stdio of a server
        started in a sandbox of its own (stopped when the session ends)."""
        if self.cfg.url:
            from mcp.client.streamable_http import streamable_http_client

            async with streamable_http_client(self.cfg.url) as streams:
                yield streams
            return
        import anyio

        argv, env, expose = launch(self.cfg, self.pool.python)
        self.sbx = None
        sbx = self.sbx = await self.pool.start_server(argv, env=env, expose=expose, memory_mb=self.cfg.memory_mb)
        read_w, read_r = anyio.create_memory_object_stream(0)
        write_w, write_r = anyio.create_memory_object_stream(0)
        pumps = [asyncio.ensure_future(_from_server(sbx, read_w)), asyncio.ensure_future(_to_server(sbx, write_r))]
        try:
            yield read_r, write_w
        finally:
            for pump in pumps:
                pump.cancel()
            await self.pool.stop_server(sbx)

    def _start_failure(self, err: BaseException) -> str:
        while isinstance(err, BaseExceptionGroup) and err.exceptions:      # the mcp package's task groups
            err = err.exceptions[0]
        if self.cfg.url:
            return (f"MCP server {self.cfg.name!r} at {self.cfg.url} did not answer (is it running?): "
                    f"{type(err).__name__}: {err}")
        stderr = bytes(self.sbx.pipes["stderr"][1].buf[-2000:]).decode("utf-8", "replace").strip() \
            if self.sbx is not None else ""
        return (f"MCP server {self.cfg.name!r} ({' '.join(self.cfg.command)}) did not start in the sandbox: "
                f"{type(err).__name__}: {err}" + (f"; its stderr ends: {stderr}" if stderr else ""))

    async def call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        session, generation = await self._ready()
        self.counts["calls"] += 1
        try:
            result = await asyncio.wait_for(session.call_tool(tool, arguments), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            return await self._failed(generation, "timeouts", f"no answer within {self.cfg.timeout_s:g} s")
        except Exception as err:  # noqa: BLE001 - the server died, flooded, or broke the protocol
            return await self._failed(generation, "deaths", f"the server failed: {type(err).__name__}: {err}")
        text = content_text(result)
        return ToolResult(text, not result.is_error, "the tool reported an error" if result.is_error else None)

    async def _ready(self) -> tuple[Any, int]:
        async with self._lock:
            if self.session is None or (not self.cfg.url and (self.sbx is None or not self.sbx.alive)):
                await self.stop()
                await self.start()
            return self.session, self.generation

    async def _failed(self, generation: int, kind: str, why: str) -> ToolResult:
        """The call is a tool error; the server it ran on is ended (the next call starts a fresh one)."""
        if not self.cfg.url and self.sbx is not None and self.sbx.budget.overflow.is_set():
            kind, why = "floods", f"the server wrote more than {self.pool.cfg.max_output_bytes} bytes at once"
        self.counts[kind] += 1
        async with self._lock:
            if generation == self.generation:
                await self.stop()
        if self.pool is not None and self.pool.audit is not None:
            self.pool.audit.record("mcp_server_failed", server=self.cfg.name, failure=kind, reason=why)
        log.warning("MCP server %s: %s (restarted for the next call)", self.cfg.name, why)
        return ToolResult(f"error: {why}", False, f"{kind}: {why}")


async def _from_server(sbx: Any, stream: Any) -> None:
    """The server's stdout lines as JSON-RPC messages to the session; ends (closing the stream, which fails the
    requests in flight) when the server ends or floods."""
    import mcp_types
    from mcp.shared.message import SessionMessage

    flood = asyncio.ensure_future(sbx.budget.overflow.wait())
    async with stream:
        try:
            while True:
                line = asyncio.ensure_future(sbx.lines.get())
                await asyncio.wait({line, flood}, return_when=asyncio.FIRST_COMPLETED)
                if not line.done() or line.result() is None:
                    line.cancel()
                    return
                if not line.result().strip():
                    continue
                try:
                    message: Any = SessionMessage(mcp_types.jsonrpc_message_adapter.validate_json(
                        line.result(), by_name=False))
                except ValueError as err:
                    message = err
                await stream.send(message)
        finally:
            flood.cancel()


async def _to_server(sbx: Any, stream: Any) -> None:
    async with stream:
        async for message in stream:
            sbx.send((message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n").encode())


class McpTool:
    """The hybridrl tool `SERVER_TOOL`: its spec is the server's listing (filled in when the box starts)."""

    def __init__(self, name: str, server: McpServer, own: str):
        self.server, self.own = server, own
        self.spec = ToolSpec(name, f"{own} (MCP server {server.cfg.name})")

    def describe(self) -> None:
        listed = self.server.tools.get(self.own)
        if listed is None:
            raise ValueError(f"tool {self.spec.name}: MCP server {self.server.cfg.name!r} has no tool {self.own!r} "
                             f"(it lists {sorted(self.server.tools)})")
        self.spec = ToolSpec(self.spec.name, listed.description or self.own,
                             listed.input_schema or {"type": "object", "properties": {}})

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        return await self.server.call(self.own, arguments)


class McpServers:
    """The servers of one `ToolBox` (each started once, when the box starts, in the box's sandbox pool)."""

    def __init__(self, box: Any):
        self.box = box
        self.servers: dict[str, McpServer] = {}
        self.tools: list[McpTool] = []

    def tool(self, name: str) -> McpTool:
        entry, own = server_of(self.box.cfg, name)
        if entry["name"] not in self.servers:
            pool = None if entry["url"] else self.box.sandbox_pool()     # a url server is not started here
            self.servers[entry["name"]] = McpServer(McpServerConfig(**entry), pool)
        tool = McpTool(name, self.servers[entry["name"]], own)
        self.tools.append(tool)
        return tool

    async def start(self) -> None:
        for server in self.servers.values():
            if server.session is None:
                await server.start()
        for tool in self.tools:
            tool.describe()
            self.box.tools[tool.spec.name] = tool

    async def close(self) -> None:
        for server in self.servers.values():
            await server.stop()

    def stats(self) -> dict[str, Any]:
        return {name: dict(s.counts) for name, s in self.servers.items()}
