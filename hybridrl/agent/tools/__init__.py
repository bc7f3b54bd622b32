"""Tools: the interface and `ToolBox` (`base`), the registry, the calculator, the sandboxed Python tool."""

from hybridrl.agent.tools.base import Tool, ToolBox, ToolResult
from hybridrl.agent.tools.registry import register_tool, tool_names

__all__ = ["Tool", "ToolBox", "ToolResult", "register_tool", "tool_names"]
