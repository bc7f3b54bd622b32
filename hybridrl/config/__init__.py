"""Typed configuration: dataclass schemas, YAML layers and `key=value` overrides.

Component configs import `hybridrl.config.fields`; the schema imports the component configs.
So this package imports the loader and schema lazily: importing any component config first
(e.g. `hybridrl.distributed.config`) must not pull the schema in half-way.
"""

from __future__ import annotations

from typing import Any

from hybridrl.config.fields import ConfigError, ConfigValueError, knob, section

_LAZY = {
    "load_config": "hybridrl.config.loader", "to_dict": "hybridrl.config.loader", "to_yaml": "hybridrl.config.loader",
    "Config": "hybridrl.config.schema", "ModelConfig": "hybridrl.config.schema", "RunConfig": "hybridrl.config.schema",
}

__all__ = ["Config", "ConfigError", "ConfigValueError", "ModelConfig", "RunConfig", "knob", "load_config",
           "section", "to_dict", "to_yaml"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridrl.config' has no attribute '{name}'")
