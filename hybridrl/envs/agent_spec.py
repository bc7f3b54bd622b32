"""`task.agent`: the agent a task's episodes run, named 'module:function' or 'module:Class' (the agent
API is the gateway's: `hybridrl/gateway/agent.py`). Here only finding it and checking its shape, which
the task section does at load, before any process starts; nothing of the user's is called but its
module's import."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Awaitable, Callable

from hybridrl.config.fields import ConfigValueError


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


def check_agent(spec: str) -> Any:
    """The function or class `spec` names, checked for the agent API's shape (nothing is called)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigValueError("agent", f"{spec!r} is not of the form 'module:function' (e.g. myagent:run)")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the user's module
        raise ConfigValueError("agent", f"cannot import {module_name!r} for task.agent={spec!r}: "
                                        f"{type(err).__name__}: {err}; run from the directory that holds it or "
                                        "add that directory to PYTHONPATH") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigValueError("agent", f"module {module_name!r} has no {attr!r}")
    fn = getattr(obj, "run", None) if inspect.isclass(obj) else obj
    if fn is None or not inspect.iscoroutinefunction(fn):
        raise ConfigValueError("agent", f"{spec!r} must be 'async def {attr}(client, instance)' or a class with "
                                        "'async def run(self, client, instance)'")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    need = 3 if inspect.isclass(obj) else 2
    if len(positional) < need and not any(p.kind == p.VAR_POSITIONAL for p in params):
        raise ConfigValueError("agent", f"{spec!r} takes (client, instance); it has {len(positional)} positional "
                                        "parameter(s)")
    return obj
