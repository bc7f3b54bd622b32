"""One HF <-> Megatron adapter per model family, chosen by the HF config's `model_type`."""

from __future__ import annotations

from typing import Any

from hybridrl.backends.megatron.adapters.base import DecoderAdapter, DecoderSpec, Role, Slot, Split
from hybridrl.backends.megatron.adapters.llama import LlamaAdapter
from hybridrl.backends.megatron.adapters.qwen2 import Qwen2Adapter

ADAPTERS: tuple[type[DecoderAdapter], ...] = (Qwen2Adapter, LlamaAdapter)

__all__ = ["ADAPTERS", "DecoderAdapter", "DecoderSpec", "LlamaAdapter", "Qwen2Adapter", "Role", "Slot",
           "Split", "adapter_for"]


def adapter_class(hf_config: Any) -> type[DecoderAdapter]:
    model_type = getattr(hf_config, "model_type", None)
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls
    known = sorted(t for cls in ADAPTERS for t in cls.model_types)
    raise ValueError(f"no Megatron adapter for model_type={model_type!r}; supported: {known}")


def adapter_for(hf_config: Any, *, tp: int = 1, vocab_divisible_by: int = 128) -> DecoderAdapter:
    """The adapter for an HF config (transformers PretrainedConfig), for tensor-parallel size `tp`."""
    cls = adapter_class(hf_config)
    return cls(cls.spec_from_hf_config(hf_config), tp=tp, vocab_divisible_by=vocab_divisible_by)
