"""`Worker`: the per-rank object whose registered methods the controller calls on every rank.

    class MyWorker(Worker):
        @register(dispatch=DPSplit("train"))
        def compute_logprobs(self, batch: Batch) -> Batch: ...

    wg.call(MyWorker.compute_logprobs, batch)      # on the controller

Methods are found through the decorator, never by a string at a call site; the name only
travels inside the control message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from hybridrl.distributed.dispatch import ONE_TO_ALL, Dispatch
from hybridrl.data.batch import Batch
from hybridrl.distributed.mesh import Mesh

if TYPE_CHECKING:
    from hybridrl.distributed.bootstrap import DistContext

_ATTR = "__hybridrl_method__"


@dataclass(frozen=True)
class RegisteredMethod:
    name: str
    fn: Callable[..., Any]
    dispatch: Dispatch
    timeout_s: float | None = None


def register(dispatch: Dispatch = ONE_TO_ALL, *, timeout_s: float | None = None):
    """Mark a worker method as callable by the controller, with its dispatch mode."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register(dispatch=...) takes a Dispatch, got {dispatch!r}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, _ATTR, RegisteredMethod(fn.__name__, fn, dispatch, timeout_s))
        return fn

    return decorate


class Worker:
    """Base of every worker class. Subclasses get `_methods`: their registered methods by name."""

    _methods: ClassVar[dict[str, RegisteredMethod]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        methods: dict[str, RegisteredMethod] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                spec = getattr(value, _ATTR, None)
                if spec is not None:
                    methods[name] = RegisteredMethod(name, value, spec.dispatch, spec.timeout_s)
                elif name in methods:
                    del methods[name]  # overridden without @register
        cls._methods = methods

    def __init__(self, ctx: "DistContext"):
        self.ctx = ctx

    def meshes(self) -> dict[str, Mesh]:
        """The named rank layouts this worker's methods split over (same on every rank)."""
        return {"world": Mesh.flat("world", self.ctx.world_size)}

    @classmethod
    def method_spec(cls, method: Callable[..., Any] | str) -> RegisteredMethod:
        name = method if isinstance(method, str) else getattr(getattr(method, _ATTR, None), "name", None)
        if name is None:
            raise TypeError(f"{getattr(method, '__qualname__', method)!r} is not a registered worker method "
                            "(decorate it with @register(dispatch=...))")
        if name not in cls._methods:
            raise TypeError(f"{cls.__name__} has no registered method '{name}'")
        return cls._methods[name]

    def invoke(self, name: str, data: Batch | None, kwargs: dict[str, Any]) -> Any:
        spec = self.method_spec(name)
        if data is None:
            return spec.fn(self, **kwargs)
        return spec.fn(self, data, **kwargs)
