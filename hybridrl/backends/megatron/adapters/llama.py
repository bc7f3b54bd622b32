"""Llama: the reference block (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases)."""

from __future__ import annotations

from typing import Any

from hybridrl.backends.megatron.adapters.base import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    family = "llama"
    model_types = ("llama",)

    @classmethod
    def check_hf_config(cls, hf_config: Any) -> None:
        super().check_hf_config(hf_config)
        # Megatron has a q/k/v-only bias (add_qkv_bias) and an all-linear bias (add_bias_linear);
        # Llama's attention_bias covers q/k/v *and* o_proj, and mlp_bias the MLP: neither maps.
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("llama: attention_bias=True is unsupported (o_proj bias has no Megatron slot)")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("llama: mlp_bias=True is unsupported")
