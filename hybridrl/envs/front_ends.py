"""The doors episodes come through (`task.front_end`): one `Registry` of `EpisodeEngine` subclasses.

A front end is a subclass of `hybridrl.agent.episodes.EpisodeEngine` (that module's doc says what it
implements). The shipped ones are named here and imported only when a run builds its runner
(`agent/episodes.py: episode_runner`); `task.front_end=module:Class` names one of your own, found by
that path. Import-light (it sits beside the task and agent registries, so the task section checks
`task.front_end` before any process starts, with a "did you mean").
"""

from __future__ import annotations

from typing import Any

from hybridrl.registry import Registry


def _target(cls: Any) -> str:
    """A front end of your own is known by the 'module:Class' that names it."""
    return f"{cls.__module__}:{cls.__qualname__}"


FRONT_ENDS: Registry[type] = Registry(
    "front end", key="front_end", row="hybridrl.agent.episodes:EpisodeEngine", subclass=True, name_of=_target,
    own="Class", shipped={
        "loop": "hybridrl.agent.loop:AgentRunner",            # actions parsed from the policy's tokens
        "gateway": "hybridrl.gateway.runner:GatewayRunner",   # an OpenAI-client agent (task.agent)
    })


def front_end_name(cfg: Any) -> str:
    """The run's front end: `task.front_end` when set, else the gateway for `task.agent`, else the loop."""
    named = cfg.task.front_end
    if named:
        return named
    return "gateway" if cfg.task.agent else "loop"
