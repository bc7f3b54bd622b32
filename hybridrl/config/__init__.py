"""Typed configuration: dataclass schemas, YAML layers and `key=value` overrides."""

from hybridrl.config.fields import ConfigError, ConfigValueError, knob, section
from hybridrl.config.loader import load_config, to_dict, to_yaml
from hybridrl.config.schema import Config, ModelConfig, RunConfig

__all__ = [
    "Config",
    "ConfigError",
    "ConfigValueError",
    "ModelConfig",
    "RunConfig",
    "knob",
    "load_config",
    "section",
    "to_dict",
    "to_yaml",
]
