"""The `rollout` section: which engine generates, its layout, and each backend's own knobs (each
backend's config beside it: the section lives among the backends it chooses from)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.backends.native.config import NativeEngineConfig
from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.backends.vllm.config import VLLMConfig
from hybridrl.config.fields import ConfigValueError, check_positive, knob, section
from hybridrl.rollout.registry import ENGINES, RolloutEngineSpec


@dataclass(kw_only=True)
class RolloutConfig:
    """The rollout engine of every rank (colocated with the trainer)."""

    engine: str = knob("native", "native (pure torch, CPU or GPU; the CPU default) | sglang (GPU extra) | vllm (CPU or "
                                 "GPU; its own venv: make vllm-venv)")
    tp: int = knob(1, "rollout tensor-parallel size: one engine per group of tp ranks, on its first rank "
                      "(the native engine has no TP: with tp > 1 its one replica serves the whole group)")
    native: NativeEngineConfig = section(NativeEngineConfig, "the native engine: KV cache, batching, prefix reuse")
    sglang: SGLangConfig = section(SGLangConfig, "the SGLang engine (GPU extra)")
    vllm: VLLMConfig = section(VLLMConfig, "the vLLM engine: KV cache, batching, threads, sleep mode (CUDA)")

    def __post_init__(self) -> None:
        ENGINES.check("engine", self.engine)
        check_positive("tp", self.tp)
        if self.engine == "vllm" and self.tp != 1:
            raise ConfigValueError("tp", "the vLLM backend runs one engine per rollout rank (tensor-parallel size 1, "
                                         "so it can read every published tensor back): set rollout.tp=1")

    @property
    def engine_row(self) -> RolloutEngineSpec:
        """The selected engine's row: its classes and what the rest of the run needs to know of it."""
        return ENGINES.get(self.engine)

