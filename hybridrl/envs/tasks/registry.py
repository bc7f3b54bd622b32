"""The task registry: every module in this package that registers a `Task` subclass, plus any
`package.module:Class` named in `task.name`. Import-light (config validation uses it)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, Mapping

from hybridrl.config.fields import ConfigValueError

if TYPE_CHECKING:
    from hybridrl.envs.config import TaskConfig
    from hybridrl.envs.tasks.base import Task

_TASKS: dict[str, type["Task"]] = {}
_NOT_TASKS = {"base", "registry"}


def register_task(cls: type["Task"]) -> type["Task"]:
    """Class decorator: make `cls` available as `task.name = cls.name`."""
    if not getattr(cls, "name", ""):
        raise TypeError(f"{cls.__name__} needs a class attribute `name`")
    other = _TASKS.get(cls.name)
    if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
        raise ValueError(f"task name {cls.name!r} is taken by {other.__module__}.{other.__qualname__}")
    _TASKS[cls.name] = cls
    return cls


def _shipped() -> list[str]:
    """The task modules of this package (a shipped task's module is named after the task); none is
    imported, so loading a config imports only the task it names."""
    import hybridrl.envs.tasks as package

    return [info.name for info in pkgutil.iter_modules(package.__path__) if info.name not in _NOT_TASKS]


def task_names() -> list[str]:
    return sorted(set(_shipped()) | set(_TASKS))


def task_class(name: str) -> type["Task"]:
    if ":" in name:
        module, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        return register_task(cls)
    if name not in _TASKS and name in _shipped():
        importlib.import_module(f"hybridrl.envs.tasks.{name}")
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {task_names()}")
    return _TASKS[name]


def task_options(name: str, options: Mapping[str, Any]) -> Any:
    """The task's typed `Options` from a plain mapping; unknown keys raise `ConfigValueError`."""
    cls = task_class(name).Options
    known = {f.name for f in dataclasses.fields(cls)}
    for key in options:
        if key not in known:
            raise ConfigValueError(key, f"unknown option of task {name!r}; known: {sorted(known)}")
    return cls(**dict(options))


def get_task(name: str, cfg: "TaskConfig | None" = None) -> "Task":
    """A task object by name; `cfg` supplies seeds, split sizes, reward weights and options."""
    from hybridrl.envs.config import TaskConfig

    if cfg is None:
        cfg = TaskConfig(name=name)
    elif cfg.name != name:
        cfg = dataclasses.replace(cfg, name=name, options={})
    return task_class(name)(cfg)
