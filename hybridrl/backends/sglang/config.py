"""The `sglang` knobs of the rollout section. Engine flags we do not model pass through `engine_args`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.config.fields import ConfigValueError, check_choice, knob


@dataclass(kw_only=True)
class SGLangConfig:
    """SGLang in-process engine, one per rollout TP group, colocated with the trainer."""

    mem_fraction_static: float = knob(0.6, "fraction of the GPU memory free at the engine's start (the trainer "
                                           "resident) for weights + KV cache: KV = fraction x free - weights")
    dtype: str = knob("bfloat16", "engine dtype: bfloat16 | float16 | float32")
    enable_memory_saver: bool = knob(True, "needed to release/resume weights and KV cache between modes")
    load_format: str = knob("dummy", "'dummy': start without weights, they arrive with the first publication")
    base_port: int = knob(31000, "first of the ports the engines use (each rank offsets it; pass unique ports)")
    context_length: int = knob(0, "max context; 0 = the model's")
    cuda_graph: bool = knob(True, "capture CUDA graphs; with the memory saver their memory is released between "
                                  "modes too (tag cuda_graph)")
    deterministic_inference: bool = knob(
        False, "sglang's enable_deterministic_inference: needed for per-request sampling seeds to take effect "
               "(without it sglang ignores them and rollouts are not reproducible); batch-invariant kernels, slower")
    engine_args: dict[str, Any] = knob(factory=dict, help="extra sglang.Engine(**kwargs), passed through unchecked")

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigValueError("mem_fraction_static", f"must be in (0, 1), got {self.mem_fraction_static}")
        check_choice("dtype", self.dtype, ("bfloat16", "float16", "float32"))
        check_choice("load_format", self.load_format, ("dummy", "auto"))

    def releasable_tags(self) -> frozenset[str]:
        """What the engine releases between modes: weights, KV cache and CUDA graphs (when captured), all
        through the memory saver (nothing without it)."""
        if not self.enable_memory_saver:
            return frozenset()
        return frozenset({"weights", "kv_cache"} | ({"cuda_graph"} if self.cuda_graph else set()))
