"""The native rollout engine: Qwen2 / Llama in plain torch, CPU or GPU.

    from hybridrl.backends.native import NativeEngine, NativeEngineConfig
    engine = NativeEngine.from_pretrained(model_dir, NativeEngineConfig(kv_cache_mb=64), device="cpu")
    out = await engine.generate(prompt_ids, SamplingParams(temperature=0.7), "req-0")

`NativeEngineConfig` is import-light (the config schema mounts it as section `rollout`);
the engine itself (torch) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hybridrl.backends.native.config import NativeEngineConfig

if TYPE_CHECKING:
    from hybridrl.backends.native.engine import NativeEngine

__all__ = ["NativeEngine", "NativeEngineConfig"]


def __getattr__(name: str) -> Any:
    if name == "NativeEngine":
        from hybridrl.backends.native.engine import NativeEngine

        return NativeEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
