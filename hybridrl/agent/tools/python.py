"""The Python tool: run a program in a fresh sandbox (see `hybridrl/agent/sandbox/`)."""

from __future__ import annotations

from typing import Any

from hybridrl.agent.actions import ToolSpec
from hybridrl.agent.tools.base import ToolResult
from hybridrl.agent.tools.registry import register_tool

_LIMIT_TEXT = {"wall_clock": "time limit", "cpu": "CPU time limit", "output": "output limit",
               "memory": "memory limit", "file_size": "file size limit"}


class PythonTool:
    def __init__(self, pool, *, max_code_chars: int = 8000):
        self.pool = pool
        self.spec = ToolSpec(
            "python", "Run a Python program (standard library only, no network) and return what it prints.",
            {"type": "object", "properties": {"code": {"type": "string", "maxLength": max_code_chars}},
             "required": ["code"]})

    async def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolResult("error: 'code' must be a string", False, "code is not a string")
        # whatever the code is (bad syntax, lone surrogates, ...), the sandbox runs it and the policy
        # sees Python's error: only a sandbox that cannot start is an infrastructure error
        r = await self.pool.run(code)
        meta = {"exit_code": r.exit_code, "signal": r.signal, "limit": r.limit_hit, "isolation": r.isolation,
                "sandbox_wall_s": r.wall_s, "oom_kills": r.oom_kills}
        if r.killed is not None:                 # the kill switch: not the policy's doing
            return ToolResult("error: tool calls are stopped by the kill switch", False, f"kill switch: {r.killed}",
                              infra_error=True, metadata=meta)
        if r.setup_error is not None:
            return ToolResult("error: the sandbox could not start", False, r.setup_error, infra_error=True,
                              metadata=meta)
        text = r.stdout
        if not r.ok:
            limit = r.limit_hit
            tail = r.stderr[-1000:]
            status = f"[stopped: {_LIMIT_TEXT[limit]}]" if limit else f"[exit code {r.exit_code}]"
            text = "\n".join(part for part in (text.rstrip("\n"), tail.rstrip("\n"), status) if part)
            return ToolResult(text, False, status.strip("[]"), metadata=meta)
        return ToolResult(text, True, metadata=meta)


@register_tool("python")
def make_python(cfg, box) -> PythonTool:
    return PythonTool(box.sandbox_pool())
