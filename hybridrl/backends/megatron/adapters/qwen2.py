"""Qwen2: Llama-style blocks with biases on q/k/v (always), tied embeddings in small models."""

from __future__ import annotations

from typing import Any

from hybridrl.backends.megatron.adapters.base import DecoderAdapter


class Qwen2Adapter(DecoderAdapter):
    family = "qwen2"
    model_types = ("qwen2",)

    @classmethod
    def check_hf_config(cls, hf_config: Any) -> None:
        super().check_hf_config(hf_config)
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError("qwen2: use_sliding_window=True is unsupported (full attention only)")
        kinds = set(getattr(hf_config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(f"qwen2: layer_types {sorted(kinds)} unsupported (full attention only)")

    @classmethod
    def has_qkv_bias(cls, hf_config: Any) -> bool:
        return True
