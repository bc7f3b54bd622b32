"""One HF <-> Megatron adapter per model family: its row's `adapter` (backends/families.py)."""

from __future__ import annotations

from typing import Any

from hybridrl.backends.megatron.adapters.base import DecoderAdapter, Role, Slot, Split
from hybridrl.backends.megatron.adapters.llama import LlamaAdapter
from hybridrl.backends.megatron.adapters.qwen2 import Qwen2Adapter
from hybridrl.backends.megatron.adapters.qwen3 import Qwen3Adapter, Qwen3MoeAdapter
from hybridrl.backends.families import family_named
from hybridrl.backends.model_spec import ModelSpec

ADAPTERS: tuple[type[DecoderAdapter], ...] = (Qwen2Adapter, LlamaAdapter, Qwen3Adapter, Qwen3MoeAdapter)

__all__ = ["ADAPTERS", "DecoderAdapter", "LlamaAdapter", "Qwen2Adapter", "Qwen3Adapter", "Qwen3MoeAdapter", "Role",
           "Slot", "Split", "adapter_for"]


def adapter_for(spec: ModelSpec | Any, *, tp: int = 1, ep: int = 1, vocab_divisible_by: int = 128) -> DecoderAdapter:
    """The adapter for a model, for tensor-parallel size `tp` and expert-parallel size `ep`. `spec`
    is a `ModelSpec` (or an HF config mapping / transformers config object, read through
    `ModelSpec.from_hf_config`)."""
    if not isinstance(spec, ModelSpec):
        spec = ModelSpec.from_hf_config(spec)
    cls = family_named(spec.arch).adapter.resolve()
    if not (isinstance(cls, type) and issubclass(cls, DecoderAdapter)):
        raise TypeError(f"model family {spec.arch!r}: its adapter {cls!r} is not a DecoderAdapter subclass")
    return cls(spec, tp=tp, ep=ep, vocab_divisible_by=vocab_divisible_by)
