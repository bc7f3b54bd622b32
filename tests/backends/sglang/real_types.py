"""Import the pinned sglang release's request types on a CPU machine, without its GPU stack.

`make sglang-types` installs the pinned wheel with `--no-deps` (plus msgspec, pyzmq, orjson,
pybase64) into `.cache/sglang-types`. Its `io_struct` module defines the request Structs with plain
msgspec, but its imports reach modules that need triton, torchvision or a GPU: those modules (none
of which defines a type used here) are replaced by permissive stand-ins, and `sglang/__init__.py`
(which imports the whole runtime) is skipped. The request classes themselves are sglang's own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / ".cache" / "sglang-types"
STAND_INS = ("triton", "torchvision", "requests", "starlette", "sglang.srt.managers.schedule_batch",
             "sglang.srt.multimodal")


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _anything(name)

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]                      # used as a decorator
        return type.__call__(cls)

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


def _anything(name: str) -> type:
    return _Anything(name, (), {"__init__": lambda self, *a, **k: None})


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _anything(name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if any(fullname == n or fullname.startswith(n + ".") for n in STAND_INS):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def load() -> tuple[types.ModuleType, type, types.ModuleType]:
    """(io_struct, FlattenedTensorMetadata, the installed sglang's version string module)."""
    sys.path.insert(0, str(ROOT))
    package = types.ModuleType("sglang")
    package.__path__ = [str(ROOT / "sglang")]
    sys.modules["sglang"] = package
    sys.meta_path.insert(0, _Finder())
    import sglang.srt.managers.io_struct as io_struct
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    version = importlib.import_module("sglang.version")
    return io_struct, FlattenedTensorMetadata, version
