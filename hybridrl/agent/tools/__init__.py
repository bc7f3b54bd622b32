"""Tools: the interface and `ToolBox` (`base`), the calculator, the sandboxed Python tool."""

from hybridrl.agent.tools.base import Tool, ToolBox, ToolResult

__all__ = ["Tool", "ToolBox", "ToolResult"]
