"""The tool interface and the `ToolBox` that owns a set of tools and their sandbox pool."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from hybridrl.agent.actions import ToolCall, ToolSpec

log = logging.getLogger(__name__)


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
        self.counts: dict[str, int] = {"calls": 0, "errors": 0, "infra_errors": 0}

    @classmethod
    def from_config(cls, cfg, names: Iterable[str] = ("calculator", "python")) -> "ToolBox":
        """The named tools (`agent/tools/registry.py`), built from the `tools` config section; the sandbox
        pool is created only if a tool asks for it."""
        from hybridrl.agent.tools.registry import tool_factory

        box = cls(cfg=cfg)
        for name in names:
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
        if self.pool is not None:
            await self.pool.start()
        return self

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    async def __aenter__(self) -> "ToolBox":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def call(self, call: ToolCall) -> ToolResult:
        """Run an authorized call. An exception inside a tool is an infrastructure error."""
        started = time.monotonic()
        self.counts["calls"] += 1
        try:
            result = await self.tools[call.name](call.arguments)
        except Exception as err:  # noqa: BLE001 - a broken tool must not kill the batch
            log.warning("tool %s raised: %s", call.name, err, exc_info=True)
            result = ToolResult(f"error: the {call.name} tool failed", False, f"{type(err).__name__}: {err}",
                                infra_error=True)
        result.latency_s = time.monotonic() - started
        self.counts["errors"] += not result.ok
        self.counts["infra_errors"] += result.infra_error
        return result

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        if self.pool is not None:
            out["sandbox"] = self.pool.stats()
        return out
