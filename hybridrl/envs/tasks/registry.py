"""The task registry: the task modules of this package (each imported when a config names it), plus any
`module:Class` named in `task.name` (imported from the working directory or PYTHONPATH).
Import-light: config validation uses it, and its errors are `ConfigValueError`s naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import pkgutil
import sys
import traceback
from pathlib import Path
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
    """The class of `task.name`: a registered name, or `module:Class` (imported here)."""
    if ":" in name:
        return _import_task(name)
    if name not in _TASKS and name in _shipped():
        importlib.import_module(f"hybridrl.envs.tasks.{name}")
    if name not in _TASKS:
        hint = difflib.get_close_matches(name, task_names(), n=1)
        did_you_mean = f"did you mean {hint[0]!r}? " if hint else ""
        raise ConfigValueError("name", f"unknown task {name!r}: {did_you_mean}registered: {task_names()}; a task of "
                                       "your own is named 'module:Class' (e.g. task.name=mytask:MyTask for "
                                       "mytask.py in the working directory)")
    return _TASKS[name]


def _import_task(name: str) -> type["Task"]:
    from hybridrl.envs.tasks.base import Task

    module_name, _, attr = name.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigValueError("name", f"{name!r} is not of the form 'module:Class' (e.g. mytask:MyTask)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            where = module_name.replace(".", "/") + ".py"
            raise ConfigValueError("name", f"cannot import task {name!r}: no module {module_name!r} in the working "
                                           f"directory ({Path.cwd()}) or on PYTHONPATH; run from the directory "
                                           f"that holds {where}, or add that directory to PYTHONPATH "
                                           f"(PYTHONPATH=DIR hybridrl ...)") from None
        raise ConfigValueError("name", f"importing {module_name!r} for task {name!r} failed: "
                                       f"{_one_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - the user's module: a SyntaxError, a NameError, ...
        raise ConfigValueError("name", f"importing {module_name!r} for task {name!r} failed: "
                                       f"{_one_line(err)}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        found = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Task) and v is not Task)
        raise ConfigValueError("name", f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                                       f"{attr!r}; the Task classes it defines: {found}")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigValueError("name", f"{name!r} is a {type(cls).__name__}, not a subclass of "
                                       "hybridrl.envs.tasks.base.Task")
    try:
        return register_task(cls)
    except (TypeError, ValueError) as err:
        raise ConfigValueError("name", f"task {name!r}: {err}") from None


def _one_line(err: BaseException) -> str:
    """`Type: message (file:line)` with the innermost frame that is not importlib's."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if isinstance(err, SyntaxError) and err.filename:
        where = f" ({err.filename}:{err.lineno})"
    message = str(err.msg if isinstance(err, SyntaxError) else err).splitlines()
    return f"{type(err).__name__}: {message[0] if message else ''}{where}"


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


def importable_from_cwd() -> None:
    """Put the working directory on sys.path, as `python -m` does, so `task.name=module:Class`
    imports the same way in the `hybridrl` command as on the ranks (`python -m hybridrl.train`)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def get_task(name: str, cfg: "TaskConfig | None" = None) -> "Task":
    """A task object by name; `cfg` supplies seeds, split sizes, reward weights and options."""
    from hybridrl.envs.config import TaskConfig

    if cfg is None:
        cfg = TaskConfig(name=name)
    elif cfg.name != name:
        cfg = dataclasses.replace(cfg, name=name, options={})
    return task_class(name)(cfg)
