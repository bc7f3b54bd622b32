"""The native rollout engine as a registered row (`rollout.registry.ENGINES`). Import-light: the config
checks read it; the engine loads when a rank builds it."""

from dataclasses import dataclass
from typing import Any

from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.registry import Lazy
from hybridrl.rollout.registry import RolloutEngineSpec

_ENGINE = "hybridrl.backends.native.engine:NativeEngine"


@dataclass(frozen=True)
class CoreClock:
    """The step counter of an engine core on the caller's event loop (`agent.collector.StepClock`)."""

    core: Any

    def steps(self) -> int:
        return self.core.counters["steps"]

    def has_work(self) -> bool:
        return self.core.has_work()


def step_clock(engine: Any) -> CoreClock | None:
    """The loop driver runs the engine's steps on the caller's event loop; the thread driver does not."""
    return CoreClock(engine.core) if engine.driver == "loop" else None

ENGINE = RolloutEngineSpec(
    "native", engine=Lazy(_ENGINE), config=NativeEngineConfig,
    colocated_transport=Lazy(f"{_ENGINE}.colocated_transport"),
    releasable_tags=Lazy(f"{_ENGINE}.releasable_tags_for"),
    serves_before_publication=True, reads_back_weights=True, remote_publication=True,
    adapter_publication=Lazy(f"{_ENGINE}.adapter_publication"), step_clock=step_clock,
    updates_in_flight=Lazy("hybridrl.backends.native.config:updates_in_flight"),
    check_run=Lazy("hybridrl.backends.native.config:check_run"),
    shares_trainer_weights=Lazy("hybridrl.backends.native.config:shares_trainer_weights"),
    summary="pure torch, CPU or GPU; the CPU default",
    section_help="the native engine: KV cache, batching, prefix reuse",
)
