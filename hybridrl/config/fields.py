"""Helpers for component configs: documented fields and validation that names the key.

Every component owns a keyword-only dataclass. Fields are declared with `knob(default, help)`
so that `hybridrl config defaults` can write the documented YAML in `configs/`, and validation
in `__post_init__` raises `ConfigValueError` naming the field, which the loader turns into a
one-line error with the full dotted key.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

_HELP = "help"


class ConfigError(Exception):
    """A configuration problem found at load time. `str(err)` is one line for the user."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None):
        self.key = key
        self.source = source
        self.detail = message
        where = f" in {source}" if source else ""
        what = f" key '{key}':" if key else ""
        super().__init__(f"config error{where}:{what} {message}")


class ConfigValueError(ValueError):
    """Raised by a config's `__post_init__`: `field` is the offending field's name."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def knob(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None):
    """A documented dataclass field. `factory` for mutable defaults; no default means required."""
    metadata = {_HELP: help}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type, help: str = ""):
    """A nested component config with its own defaults."""
    return dataclasses.field(default_factory=cls, metadata={_HELP: help})


def field_help(f: dataclasses.Field) -> str:
    return f.metadata.get(_HELP, "")


def items_of(cls: type, key: str, items: Iterable[Any]) -> list[Any]:
    """A list field's items as `cls` instances. The config loader hands a list of dataclasses over as
    mappings whose values it has already typed; a failed check of an item names `key[i].field`."""
    out = []
    for i, item in enumerate(items):
        try:
            out.append(item if isinstance(item, cls) else cls(**item))
        except ConfigValueError as err:
            raise ConfigValueError(f"{key}[{i}].{err.field}", str(err)) from None
        except TypeError as err:
            raise ConfigValueError(f"{key}[{i}]", str(err)) from None
    return out


def check_choice(field: str, value: Any, choices: Iterable[Any]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ConfigValueError(field, f"expected one of {list(choices)}, got {value!r}")


def check_positive(field: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigValueError(field, f"must be {bound}, got {value!r}")


def check_range(field: str, value: float, low: float, high: float) -> None:
    if not (low <= value <= high):
        raise ConfigValueError(field, f"must be in [{low}, {high}], got {value!r}")
