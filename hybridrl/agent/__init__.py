"""The async agent layer: episodes (`loop`), actions (`actions`), tools and their sandbox.

Exports are lazy so that `hybridrl.agent.config` stays import-light (no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AgentConfig": "hybridrl.agent.config",
    "ToolsConfig": "hybridrl.agent.config",
    "AgentRunner": "hybridrl.agent.loop",
    "run_episodes": "hybridrl.agent.loop",
    "ToolBox": "hybridrl.agent.tools.base",
    "ActionParser": "hybridrl.agent.actions",
    "ToolAuthorizer": "hybridrl.agent.actions",
    "SandboxPool": "hybridrl.agent.sandbox.pool",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybridrl.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
