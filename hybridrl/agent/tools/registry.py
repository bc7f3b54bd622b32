"""The tool registry: the shipped tools (one module each in this package, named after the tool) and
any tool a task's own module registers (it is imported before any episode runs).

A tool is registered by a factory `(cfg: ToolsConfig, box: ToolBox) -> Tool` under the name task
instances list in `TaskInstance.tools` (and the tool's `spec.name`); the box hands out shared
resources (the sandbox pool) on demand:

    @register_tool("python")
    def make_python(cfg, box):
        return PythonTool(box.sandbox_pool())
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from hybridrl.agent.tools.base import Tool, ToolBox

ToolFactory = Callable[[Any, "ToolBox"], "Tool"]

_TOOLS: dict[str, ToolFactory] = {}
_NOT_TOOLS = {"base", "registry"}


def register_tool(name: str) -> Callable[[ToolFactory], ToolFactory]:
    """Decorator: make the factory available as the tool `name`."""
    if not name:
        raise ValueError("a tool needs a non-empty name")

    def decorate(factory: ToolFactory) -> ToolFactory:
        other = _TOOLS.get(name)
        if other is not None and other.__qualname__ != factory.__qualname__:
            raise ValueError(f"tool name {name!r} is taken by {other.__module__}.{other.__qualname__}")
        _TOOLS[name] = factory
        return factory

    return decorate


def _shipped() -> list[str]:
    import hybridrl.agent.tools as package

    return [info.name for info in pkgutil.iter_modules(package.__path__) if info.name not in _NOT_TOOLS]


def tool_names() -> list[str]:
    return sorted(set(_shipped()) | set(_TOOLS))


def tool_factory(name: str) -> ToolFactory:
    """The factory of a shipped or registered tool."""
    if name not in _TOOLS and name in _shipped():
        importlib.import_module(f"hybridrl.agent.tools.{name}")
    if name not in _TOOLS:
        raise ValueError(f"unknown tool {name!r}; known: {tool_names()} (a tool of your own: decorate its "
                         "factory with hybridrl.agent.tools.register_tool('name') in a module your task imports)")
    return _TOOLS[name]
