"""The rollout side's protocol (engines) and their registry; backends (and the `rollout` section) live in
hybridrl/backends.

Exports are lazy so that `hybridrl.rollout.registry` (read by the config of the `rollout` section) stays import-light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    **{name: "hybridrl.rollout.protocol" for name in (
        "SAMPLER_CONTRACT", "SAMPLER_CONTRACT_VERSION", "FinishReason", "GenerationOutput", "GenerationTimings",
        "RolloutEngine", "SamplingParams")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridrl.rollout' has no attribute '{name}'")
