"""`task.agent`: the agent a task's episodes run, named 'module:function' or 'module:Class' (the agent
API is the gateway's: `hybridrl/gateway/agent.py`). Here only finding it and checking its shape, which
the task section does at load, before any process starts; nothing of the user's is called but its
module's import."""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable

from hybridrl.config.fields import ConfigValueError
from hybridrl.registry import Registry


AgentFn = Callable[[Any, Any], Awaitable[Any]]


def load_agent(spec: str) -> AgentFn:
    """`module:function` (an async function of (client, instance)) or `module:Class` (its instances' async
    `run(client, instance)`, made here with no arguments), imported from the working directory or
    PYTHONPATH. Errors are `ConfigValueError`s naming `agent`."""
    obj = check_agent(spec)
    if inspect.isclass(obj):
        try:
            return obj().run
        except Exception as err:  # noqa: BLE001 - the user's constructor
            raise ConfigValueError("agent", f"{spec!r}() failed: {type(err).__name__}: {err}") from None
    return obj


def _agent_shape(obj: Any) -> str | None:
    """The agent API's shape: an async function of (client, instance), or a class whose instances have one
    as `run` (nothing is called)."""
    fn = getattr(obj, "run", None) if inspect.isclass(obj) else obj
    if fn is None or not inspect.iscoroutinefunction(fn):
        return "must be 'async def fn(client, instance)' or a class with 'async def run(self, client, instance)'"
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    need = 3 if inspect.isclass(obj) else 2
    if len(positional) < need and not any(p.kind == p.VAR_POSITIONAL for p in params):
        return f"takes (client, instance); it has {len(positional)} positional parameter(s)"
    return None


AGENTS: Registry[Any] = Registry("agent", key="agent", accept=_agent_shape, own="function")


def check_agent(spec: str) -> Any:
    """The function or class `spec` names, checked for the agent API's shape (nothing is called)."""
    return AGENTS.get(spec)
