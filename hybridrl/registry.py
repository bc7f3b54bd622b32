"""One registry for every plug-in point: a name -> a declared row (a frozen dataclass, or a class).

Each plug-in point (`run.job`, `placement.mode`, `rollout.engine`, `train.engine`, `algo.advantage`,
`algo.policy_loss`, `task.name`, `task.agent`, `trainer.callbacks`) is one `Registry`. Its entries are

    declared rows          `register(row)` where the plug-in point is defined (the row's behaviour may
                           be `Lazy("module:attr")`, imported when first called)
    shipped targets        `shipped={name: "module:ATTR"}`: imported when first looked up
    a shipped package      `package=...`: one module per entry, named after it (its `attr`, or a module
                           that registers itself on import); listed without importing any
    your own               `module:ATTR`, imported from the working directory or PYTHONPATH

Every entry is type-checked when it comes in, and a name that is not there is a `ConfigValueError`
naming the config key, with a "did you mean". Import-light: no torch, nothing of the components.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import pkgutil
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Iterable, Mapping, Optional, TypeVar

from hybridrl.config.fields import ConfigValueError

T = TypeVar("T")


def importable_from_cwd() -> None:
    """Put the working directory on sys.path, as `python -m` does, so a `module:ATTR` imports the same
    way in the `hybridrl` command as on the ranks (`python -m hybridrl.train`)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def one_line(err: BaseException) -> str:
    """`Type: message (file:line)` with the innermost frame that is not importlib's."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if isinstance(err, SyntaxError) and err.filename:
        where = f" ({err.filename}:{err.lineno})"
    message = str(err.msg if isinstance(err, SyntaxError) else err).splitlines()
    return f"{type(err).__name__}: {message[0] if message else ''}{where}"


def split_target(target: str, *, key: str = "", what: str = "ATTR") -> tuple[str, str]:
    """'module:ATTR' -> (module, ATTR); ConfigValueError naming `key` when it is not of that form."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ConfigValueError(key, f"{target!r} is not of the form 'module:{what}' (e.g. mymodule:My{what.title()})")
    return module_name, attr


def import_module(module_name: str, *, key: str = "", purpose: str = "") -> Any:
    """The module, or a one-line ConfigValueError saying where it was looked for and why it failed."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            where = module_name.replace(".", "/") + ".py"
            raise ConfigValueError(key, f"cannot import {module_name} for {purpose}: no module {module_name!r} in "
                                        f"the working directory ({Path.cwd()}) or on PYTHONPATH; run from the "
                                        f"directory that holds {where}, or add that directory to PYTHONPATH "
                                        "(PYTHONPATH=DIR hybridrl ...)") from None
        raise ConfigValueError(key, f"importing {module_name!r} for {purpose} failed: {one_line(err)}") from None
    except Exception as err:  # noqa: BLE001 - the user's module: a SyntaxError, a NameError, ...
        raise ConfigValueError(key, f"importing {module_name!r} for {purpose} failed: {one_line(err)}") from None


def load(target: str, *, key: str = "", purpose: str = "") -> Any:
    """The object `module:ATTR` names (imported here)."""
    module_name, attr = split_target(target, key=key)
    module = import_module(module_name, key=key, purpose=purpose or repr(target))
    found = vars(module).get(attr)
    if found is None:
        raise ConfigValueError(key, f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no {attr!r}")
    return found


def load_function(spec: str, *, key: str, purpose: str) -> Callable[..., Any]:
    """The function `module:function` (imported from the working directory or PYTHONPATH) or
    `path/to/file.py:function` (that file, executed as a module of its own) names; ConfigValueError naming
    `key` when the spec is malformed, the file is missing, its import fails or it has no such function."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigValueError(key, f"{spec!r} is not 'module:function' or 'path/to/file.py:function'")
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise FileNotFoundError(f"no file {where} (relative paths are from {Path.cwd()})")
            file_spec = importlib.util.spec_from_file_location(f"_hybridrl_user_{Path(where).stem}", where)
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
        else:
            importable_from_cwd()
            module = importlib.import_module(where)
    except Exception as err:  # noqa: BLE001 - the user's module: any import error is theirs to see
        raise ConfigValueError(key, f"cannot load {where!r} for {purpose}: {one_line(err)}") from None
    fn = vars(module).get(attr)
    if not callable(fn):
        raise ConfigValueError(key, f"{where!r} has no function {attr!r} (for {purpose})")
    return fn


@dataclass(frozen=True)
class Lazy:
    """A function of a shipped row named by 'module:attr' (or 'module:Class.method'), imported on its
    first call: a row declares its behaviour without importing it (torch, Megatron, an engine)."""

    target: str

    def resolve(self) -> Any:
        module_name, _, path = self.target.partition(":")
        found = importlib.import_module(module_name)
        for part in path.split("."):
            found = vars(found)[part] if not isinstance(found, type) else getattr(found, part)
        return found

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)


def _row_name(entry: Any) -> str:
    return entry.name


class Registry(Generic[T]):
    """The entries of one plug-in point, by name (see the module doc). `row`: the type every entry is
    (an instance of it; a subclass of it with `subclass=True`; a 'module:Class' is imported when first
    needed); `accept(entry)`: a further check, the problem as a string or None."""

    def __init__(self, kind: str, *, key: str, row: "type | str | None" = None, subclass: bool = False,
                 shipped: Optional[Mapping[str, str]] = None, package: str = "", attr: str = "",
                 exclude: Iterable[str] = (), accept: Optional[Callable[[Any], Optional[str]]] = None,
                 name_of: Callable[[Any], str] = _row_name, own: str = "ATTR"):
        self.kind, self.key, self._row, self.subclass = kind, key, row, subclass
        self.targets = dict(shipped or {})
        self.package, self.attr, self.exclude = package, attr, set(exclude)
        self.accept, self.name_of, self.own = accept, name_of, own
        self._entries: dict[str, T] = {}         # by name: declared, register()ed, shipped once imported
        self._imported: dict[str, T] = {}        # by 'module:ATTR'
        self._ambiguous: dict[str, list[str]] = {}  # a name two different classes claimed: only module:ATTR finds them

    # -- what is there -----------------------------------------------------------------------------

    def shipped(self) -> list[str]:
        """The shipped names, none imported: the declared targets and the modules of the package."""
        names = set(self.targets)
        if self.package:
            package = importlib.import_module(self.package)
            names |= {info.name for info in pkgutil.iter_modules(package.__path__)
                      if not info.name.startswith("_") and info.name not in self.exclude}
        return sorted(names)

    def names(self) -> list[str]:
        return sorted(set(self.shipped()) | set(self._entries))

    def rows(self) -> list[T]:
        """Every shipped and registered entry (imports the shipped ones)."""
        return [self.get(name) for name in self.names()]

    def known(self, name: str) -> bool:
        """A shipped or registered name (nothing imported)."""
        if name in self._ambiguous:
            return False
        return name in self._entries or name in self.targets or (":" not in name and name in self.shipped())

    # -- in and out --------------------------------------------------------------------------------

    def register(self, entry: T, *, name: str = "", key: str = "", shipped: bool = False) -> T:
        """Add `entry` (type-checked) under `name` (default: its own); a name taken by another entry is
        refused (the same class imported again is the same entry)."""
        problem = self._problem(entry)
        if problem:
            raise ConfigValueError(key or self.key, problem)
        name = name or self.name_of(entry)
        if not shipped and name not in self._entries and name in self.shipped() and not self._ours(entry):
            raise ConfigValueError(key or self.key, f"{_describe(entry)} takes the name {name!r} of a shipped "
                                                    f"{self.kind}: give it another name")
        if name in self._ambiguous:
            self._ambiguous[name] = sorted({*self._ambiguous[name], _describe(entry)})
            return entry
        other = self._entries.get(name)
        if other is not None and other is not entry and not _same_class(other, entry):
            if not (isinstance(other, type) and isinstance(entry, type)):
                raise ConfigValueError(key or self.key, f"{self.kind} name {name!r} is taken by {_describe(other)}")
            # two classes of the user's (feet.py and tasks/feet.py, say): each is still found by its
            # 'module:Class' path, and the bare name, which no longer says which, is refused when asked for
            self._ambiguous[name] = sorted({_describe(other), _describe(entry)})
            del self._entries[name]
            return entry
        self._entries[name] = entry
        return entry

    def get(self, name: str, *, key: str = "") -> T:
        """The entry called `name` (a shipped one is imported here); ConfigValueError naming `key`."""
        key = key or self.key
        if name in self._entries:
            return self._entries[name]
        if name in self._ambiguous:
            raise ConfigValueError(key, f"{self.kind} name {name!r} is claimed by {' and '.join(self._ambiguous[name])}: "
                                        f"name the one you mean as 'module:{self.own}'")
        if name in self._imported:
            return self._imported[name]
        if ":" in name:
            return self._import(name, key)
        if name in self.targets:
            return self.register(Lazy(self.targets[name]).resolve(), name=name, key=key, shipped=True)
        if name in self.shipped():
            return self._import_shipped_module(name, key)
        hint = difflib.get_close_matches(name, self.names(), n=1)
        raise ConfigValueError(key, f"unknown {self.kind} {name!r}: {f'did you mean {hint[0]!r}? ' if hint else ''}"
                                    f"expected one of {self.names()}, or for one of your own expected module:"
                                    f"{self.own} ('module:{self.own}' naming {self._expected()} importable from the "
                                    "working directory or PYTHONPATH)")

    def check(self, key: str, name: str, *, load: bool = True) -> None:
        """Config validation: a shipped or registered name passes without an import; `module:ATTR` is
        imported and checked (only its form, with `load=False`)."""
        if self.known(name):
            return
        if ":" in name and not load:
            split_target(name, key=key, what=self.own)
            return
        self.get(name, key=key)

    # -- helpers -----------------------------------------------------------------------------------

    def row(self) -> Optional[type]:
        if isinstance(self._row, str):
            self._row = Lazy(self._row).resolve()
        return self._row  # type: ignore[return-value]

    def _expected(self) -> str:
        row = self.row()
        if row is None:
            return f"a {self.kind}"
        what = f"{row.__module__}.{row.__qualname__}"
        return f"a subclass of {what}" if self.subclass else f"an {what}"

    def _problem(self, entry: Any) -> Optional[str]:
        row = self.row()
        if row is not None:
            ok = isinstance(entry, type) and issubclass(entry, row) if self.subclass else isinstance(entry, row)
            if not ok:
                what = "" if isinstance(entry, type) else f" a {type(entry).__name__},"
                return f"{_describe(entry)} is{what} not {self._expected()}"
        return self.accept(entry) if self.accept is not None else None

    def _import(self, target: str, key: str) -> T:
        module_name, attr = split_target(target, key=key, what=self.own)
        module = import_module(module_name, key=key, purpose=f"{self.kind} {target!r}")
        entry = vars(module).get(attr)
        if entry is None:
            raise ConfigValueError(key, f"module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                                        f"{attr!r}{self._defined_in(module)}")
        problem = self._problem(entry)
        if problem:
            raise ConfigValueError(key, f"{target!r}: {problem}")
        if self.subclass:            # a class with a name of its own is also found by that name
            self.register(entry, key=key)
        self._imported[target] = entry
        return entry

    def _ours(self, entry: Any) -> bool:
        """Defined in this registry's package (a shipped entry registering itself as its module is imported)."""
        module = entry.__module__ if isinstance(entry, (type, types.FunctionType)) else type(entry).__module__
        return bool(self.package) and (module == self.package or module.startswith(self.package + "."))

    def _defined_in(self, module: Any) -> str:
        row = self.row()
        if row is None or not self.subclass:
            return ""
        found = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, row) and v is not row)
        return f"; the {row.__name__} classes it defines: {found}"

    def _import_shipped_module(self, name: str, key: str) -> T:
        module = importlib.import_module(f"{self.package}.{name}")
        if self.attr:
            return self.register(vars(module)[self.attr], name=name, key=key, shipped=True)
        if name not in self._entries:
            raise ConfigValueError(key, f"{self.package}.{name} registers no {self.kind} {name!r}")
        return self._entries[name]


def _same_class(a: Any, b: Any) -> bool:
    """The same class imported twice (a module run as a script and imported, say)."""
    return isinstance(a, type) and isinstance(b, type) and (a.__module__, a.__qualname__) == (b.__module__,
                                                                                              b.__qualname__)


def _describe(entry: Any) -> str:
    if isinstance(entry, type):
        return f"{entry.__module__}.{entry.__qualname__}"
    return repr(entry) if len(repr(entry)) < 80 else type(entry).__name__
