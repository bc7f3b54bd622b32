"""What a rank serves: a `Worker` holding the parts its placement gives it, whose registered methods
the controller calls.

    class TrainSide(Part):
        @register(dispatch=DPSplit("train"))
        def compute_logprobs(self, batch: Batch) -> Batch: ...

    wg.call(TrainSide.compute_logprobs, batch)      # on the controller

A registered method is named by the class that declares it (`TrainSide.compute_logprobs`); the
name travels inside the control message, never as a string at a call site. On each rank the call
runs on the part that is an instance of that class (a subclass's override included); a rank that
holds no such part takes no part in the call (its dispatch mode sends it nothing and collects
nothing from it). So a placement chooses which parts each rank holds, and no rank answers for work
done elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable

from hybridrl.distributed.dispatch import ONE_TO_ALL, Dispatch
from hybridrl.data.batch import Batch
from hybridrl.distributed.mesh import Mesh

if TYPE_CHECKING:
    from hybridrl.distributed.bootstrap import DistContext

_ATTR = "__hybridrl_method__"


@dataclass(frozen=True)
class RegisteredMethod:
    name: str                       # "DeclaringClass.method": what the control message carries
    attr: str                       # the attribute on the part ("method")
    fn: Callable[..., Any]
    dispatch: Dispatch
    timeout_s: float | None = None


def register(dispatch: Dispatch = ONE_TO_ALL, *, timeout_s: float | None = None):
    """Mark a part's method as callable by the controller, with its dispatch mode."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register(dispatch=...) takes a Dispatch, got {dispatch!r}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _ATTR, RegisteredMethod(fn.__name__, fn.__name__, fn, dispatch, timeout_s))
        return fn

    return decorate


class Part:
    """Anything whose registered methods the controller calls (a side of a rank, the link between
    them, the worker itself). Each class names the registered methods it declares after itself."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, value in list(vars(cls).items()):
            spec = getattr(value, _ATTR, None)
            if spec is not None and spec.fn is value:
                setattr(value, _ATTR, replace(spec, name=f"{cls.__qualname__}.{attr}", attr=attr))

    def memory(self) -> dict[str, Any]:
        """What this part holds in memory now (bytes by accounting), for the rank's memory report."""
        return {}

    def close(self) -> None:
        """Release what this part holds (engines, tools, threads) at the end of the run."""

    @classmethod
    def registered(cls) -> dict[str, RegisteredMethod]:
        """Every registered method this class answers, by its declared name (overrides included)."""
        out: dict[str, RegisteredMethod] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                spec = getattr(value, _ATTR, None)
                if spec is not None:
                    out[spec.name] = spec
        return out


def method_spec(method: Callable[..., Any]) -> RegisteredMethod:
    """The registration of a method the controller names (`wg.call(TrainSide.update_policy, ...)`)."""
    spec = getattr(method, _ATTR, None)
    if spec is None or "." not in spec.name:
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} is not a registered method of a part "
                        "(decorate it with @register(dispatch=...) inside a Part subclass)")
    return spec


class Worker(Part):
    """The object a rank serves: itself plus the parts its placement gave it, and the named rank
    layouts (`meshes`) the dispatch modes split over. Subclass it for a job whose rank needs no
    parts (its own registered methods are found the same way)."""

    def __init__(self, ctx: "DistContext", parts: Iterable[Part] = (), meshes: dict[str, Mesh] | None = None):
        self.ctx = ctx
        self.parts: list[Part] = []
        self._meshes = meshes
        self._index: dict[str, tuple[Part, str]] = {}
        self.extend(self, *parts)

    def extend(self, *parts: Part) -> "Worker":
        """Hold more parts (an experiment's probe beside a placement's sides); returns self."""
        for part in parts:
            for name, spec in type(part).registered().items():
                if name in self._index and self._index[name][0] is not part:
                    raise TypeError(f"two parts of this rank answer {name}: {type(self._index[name][0]).__name__} "
                                    f"and {type(part).__name__}")
                self._index[name] = (part, spec.attr)
            self.parts.append(part)
        return self

    def meshes(self) -> dict[str, Mesh]:
        """The named rank layouts this worker's methods split over (the same on every rank)."""
        return dict(self._meshes) if self._meshes is not None else {"world": Mesh.flat("world", self.ctx.world_size)}

    def part(self, kind: type) -> Any:
        """This rank's part of that class, or None when its placement gave it none."""
        return next((p for p in self.parts if isinstance(p, kind)), None)

    @classmethod
    def method_spec(cls, method: Callable[..., Any]) -> RegisteredMethod:
        return method_spec(method)

    def holds(self, name: str) -> bool:
        return name in self._index

    def invoke(self, name: str, data: Batch | None, kwargs: dict[str, Any]) -> Any:
        """Run registered method `name` on the part of this rank that declares it; None on a rank that
        holds no such part (its dispatch collects nothing from it)."""
        if name not in self._index:
            return None
        part, attr = self._index[name]
        fn = getattr(part, attr)
        return fn(**kwargs) if data is None else fn(data, **kwargs)
