"""The tool interface and the `ToolBox` that owns a set of tools, their sandbox pool and the kill
switch's watcher (`hybridrl/agent/killswitch.py`)."""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from hybridrl.agent.actions import ToolCall, ToolSpec

log = logging.getLogger(__name__)

# the tool call running in this task (set by ToolBox.call): {"episode": ..., "call": ...}; the sandbox
# pool puts it in its audit records
TOOL_CALL: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("hybridrl_tool_call",
                                                                                   default=None)


@dataclass
class ToolResult:
    text: str                        # what the model sees (untrusted text; the loop sanitises it)
    ok: bool
    error: str | None = None         # short reason when not ok (the call's fault or a limit)
    infra_error: bool = False        # the tool system failed, not the call: the episode is INFRA_INVALID
    latency_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)


class Tool(Protocol):
    spec: ToolSpec

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult: ...


class ToolBox:
    """Named tools plus the resources they share (the sandbox pool). Use `async with`."""

    def __init__(self, tools: Iterable[Tool] = (), *, pool: Any = None, cfg: Any = None):
        self.tools = {t.spec.name: t for t in tools}
        self.pool = pool
        self.cfg = cfg
        self.counts: dict[str, int] = {"calls": 0, "errors": 0, "infra_errors": 0, "killed": 0}
        self.killed: str | None = None           # the kill switch tripped (why): no call runs
        self.mcp: Any = None                     # the MCP servers of its `tools.mcp` tools (agent/mcp.py)
        self._watcher = None

    @classmethod
    def from_config(cls, cfg, names: Iterable[str] = ("calculator", "python")) -> "ToolBox":
        """The named tools (`agent/tools/registry.py`), built from the `tools` config section; the sandbox
        pool is created only if a tool asks for it."""
        from hybridrl.agent.tools.registry import tool_factory

        from hybridrl.agent.mcp import McpServers, server_of

        box = cls(cfg=cfg)
        for name in names:
            if server_of(cfg, name) is not None:        # a tool of an MCP server (`tools.mcp`)
                box.mcp = box.mcp or McpServers(box)
                box.tools[name] = box.mcp.tool(name)
                continue
            tool = tool_factory(name)(cfg, box)
            if tool.spec.name != name:
                raise ValueError(f"the factory registered as tool {name!r} made a tool named {tool.spec.name!r}")
            box.tools[name] = tool
        return box

    def sandbox_pool(self) -> Any:
        """The sandbox pool shared by this box's tools (created on first request)."""
        if self.pool is None:
            from hybridrl.agent.sandbox.pool import SandboxPool

            if self.cfg is None:
                raise ValueError("this ToolBox has no tools config to build a sandbox pool from")
            self.pool = SandboxPool(self.cfg)
        return self.pool

    @property
    def specs(self) -> dict[str, ToolSpec]:
        return {name: t.spec for name, t in self.tools.items()}

    async def start(self) -> "ToolBox":
        self._watch()
        if self.pool is not None:
            await self.pool.start()
        if self.mcp is not None:
            await self.mcp.start()
        return self

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self.mcp is not None:
            await self.mcp.close()
        if self.pool is not None:
            await self.pool.close()

    def _watch(self) -> None:
        """Start the kill switch's watcher thread (once; only when the config names a switch file)."""
        from hybridrl.agent import killswitch
        from hybridrl.telemetry import audit

        path = audit.configured_path(self.cfg.kill_switch if self.cfg is not None else None)
        if path is None or self._watcher is not None:
            return
        self._watcher = killswitch.Watcher(path, self.kill)
        self._watcher.check()
        self._watcher.start()

    def kill(self, reason: str) -> None:
        """Stop every call in flight and refuse the rest (any thread: the kill switch)."""
        if self.killed is None:
            self.killed = reason
            log.warning("kill switch: %s: every tool call stops", reason)
        if self.pool is not None:
            self.pool.kill(reason)

    async def __aenter__(self) -> "ToolBox":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def call(self, call: ToolCall, *, context: dict[str, Any] | None = None) -> ToolResult:
        """Run an authorized call. An exception inside a tool is an infrastructure error, and so is a
        call the kill switch stopped (neither is the policy's doing). `context` (episode, call id)
        goes with the call into the audit log."""
        started = time.monotonic()
        self.counts["calls"] += 1
        token = TOOL_CALL.set(context)
        try:
            if self.killed is not None:
                raise _Killed(self.killed)
            result = await self.tools[call.name](call.arguments)
            if self.killed is not None:                   # tripped during the call
                raise _Killed(self.killed)
        except _Killed as err:
            self.counts["killed"] += 1
            result = ToolResult("error: tool calls are stopped by the kill switch", False, f"kill switch: {err}",
                                infra_error=True)
        except Exception as err:  # noqa: BLE001 - a broken tool must not kill the batch
            log.warning("tool %s raised: %s", call.name, err, exc_info=True)
            result = ToolResult(f"error: the {call.name} tool failed", False, f"{type(err).__name__}: {err}",
                                infra_error=True)
        finally:
            TOOL_CALL.reset(token)
        result.latency_s = time.monotonic() - started
        self.counts["errors"] += not result.ok
        self.counts["infra_errors"] += result.infra_error
        return result

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        if self.pool is not None:
            out["sandbox"] = self.pool.stats()
        if self.mcp is not None:
            out["mcp"] = self.mcp.stats()
        return out


class _Killed(Exception):
    """The kill switch stopped this call."""
