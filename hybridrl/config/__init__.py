"""Typed configuration: dataclass schemas, YAML layers and `key=value` overrides.

Component configs import `hybridrl.config.fields`; the root schema names them in a table
(`schema.SECTIONS`) and imports them only when it is first built, so this package imports no
component and importing any component config first never pulls the schema in half-way.
"""

from __future__ import annotations

from typing import Any

from hybridrl.config.fields import ConfigError, ConfigValueError, knob, section

_LAZY = {
    "load_config": "hybridrl.config.loader", "to_dict": "hybridrl.config.loader", "to_yaml": "hybridrl.config.loader",
    "ModelConfig": "hybridrl.backends.model_config", "RunConfig": "hybridrl.jobs",
}

__all__ = ["Config", "ConfigError", "ConfigValueError", "ModelConfig", "RunConfig", "knob", "load_config",
           "section", "to_dict", "to_yaml"]


def __getattr__(name: str) -> Any:
    if name == "Config":                  # the root class, assembled from the registered sections
        from hybridrl.config.schema import root

        return root()
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybridrl.config' has no attribute '{name}'")
