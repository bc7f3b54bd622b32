"""The native rollout engine as a registered row (`rollout.registry.ENGINES`). Import-light: the config
checks read it; the engine loads when a rank builds it."""

from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.registry import Lazy
from hybridrl.rollout.registry import RolloutEngineSpec

_ENGINE = "hybridrl.backends.native.engine:NativeEngine"

ENGINE = RolloutEngineSpec(
    "native", engine=Lazy(_ENGINE), config=NativeEngineConfig,
    colocated_transport=Lazy(f"{_ENGINE}.colocated_transport"),
    releasable_tags=Lazy(f"{_ENGINE}.releasable_tags_for"),
    serves_before_publication=True, reads_back_weights=True, remote_publication=True,
    adapter_publication=Lazy(f"{_ENGINE}.adapter_publication"),
    updates_in_flight=Lazy("hybridrl.backends.native.config:updates_in_flight"),
    summary="pure torch, CPU or GPU; the CPU default",
    section_help="the native engine: KV cache, batching, prefix reuse",
)
