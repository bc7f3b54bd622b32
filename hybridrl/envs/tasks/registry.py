"""The task registry: the task modules of this package (each imported when a config names it), plus any
`module:Class` named in `task.name` (imported from the working directory or PYTHONPATH).
Import-light: config validation uses it, and its errors are `ConfigValueError`s naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import TYPE_CHECKING, Any, Mapping

from hybridrl.config.fields import ConfigValueError
from hybridrl.registry import Registry, importable_from_cwd

if TYPE_CHECKING:
    from hybridrl.envs.config import TaskConfig
    from hybridrl.envs.tasks.base import Task

__all__ = ["TASKS", "check_options", "get_task", "importable_from_cwd", "register_task", "task_class", "task_names",
           "task_options"]


def _named(cls: Any) -> str | None:
    return None if cls.name else f"{cls.__name__} needs a class attribute `name`"


# a shipped task's module is named after the task and registers it on import
TASKS: Registry[type["Task"]] = Registry("task", key="name", row="hybridrl.envs.tasks.base:Task", subclass=True,
                                         package="hybridrl.envs.tasks", exclude={"base", "registry"}, accept=_named,
                                         own="Class")


def register_task(cls: type["Task"]) -> type["Task"]:
    """Class decorator: make `cls` available as `task.name = cls.name`."""
    return TASKS.register(cls)


def task_names() -> list[str]:
    return TASKS.names()


def task_class(name: str) -> type["Task"]:
    """The class of `task.name`: a shipped or registered name, or `module:Class` (imported here)."""
    return TASKS.get(name)


def check_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options as given, each coerced to its type in the task's `Options` dataclass and the
    whole set validated by it. Raises `ConfigValueError` naming `options.<key>`."""
    instance = task_options(name, options)
    return {key: getattr(instance, key) for key in options}


def task_options(task: "str | type[Task]", options: Mapping[str, Any]) -> Any:
    """The typed `Options` instance of a task (by `task.name` or class) from a plain mapping
    (`key=value` strings coerced to the field types); None for a task without options."""
    from hybridrl.config.loader import structured

    task = task if isinstance(task, type) else task_class(task)
    name, cls = task.name, task.Options
    if not dataclasses.is_dataclass(cls):
        if options:
            raise ConfigValueError(f"options.{next(iter(options))}", f"task {name!r} takes no options")
        return None
    known = [f.name for f in dataclasses.fields(cls)]
    for key in options:
        if key not in known:
            hint = difflib.get_close_matches(key, known, n=1)
            raise ConfigValueError(f"options.{key}", f"unknown option of task {name!r}"
                                                     + (f"; did you mean {hint[0]!r}?" if hint else "")
                                                     + f" (its options: {', '.join(known)})")
    try:
        return structured(cls, options)
    except ConfigValueError as err:
        raise ConfigValueError(f"options.{err.field}" if err.field else "options", str(err)) from None


def get_task(name: str, cfg: "TaskConfig | None" = None) -> "Task":
    """A task object by name; `cfg` supplies seeds, split sizes, reward weights and options."""
    from hybridrl.envs.config import TaskConfig

    if cfg is None:
        cfg = TaskConfig(name=name)
    elif cfg.name != name:
        cfg = dataclasses.replace(cfg, name=name, options={})
    return task_class(name)(cfg)
