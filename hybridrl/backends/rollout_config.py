"""The `rollout` section: which engine generates, its layout, and each backend's own knobs (each
backend's config beside it: the section lives among the backends it chooses from)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.config.fields import check_choice, check_positive, knob, section
from hybridrl.rollout.registry import ENGINES


@dataclass(kw_only=True)
class RolloutConfig:
    """The rollout engine of every rank (colocated with the trainer)."""

    engine: str = knob("native", "native (pure torch, CPU or GPU; the CPU default) | sglang (GPU extra)")
    tp: int = knob(1, "rollout tensor-parallel size: one engine per group of tp ranks, on its first rank "
                      "(the native engine has no TP: with tp > 1 its one replica serves the whole group)")
    native: NativeEngineConfig = section(NativeEngineConfig, "the native engine: KV cache, batching, prefix reuse")
    sglang: SGLangConfig = section(SGLangConfig, "the SGLang engine (GPU extra)")

    def __post_init__(self) -> None:
        check_choice("engine", self.engine, sorted(ENGINES))
        check_positive("tp", self.tp)

