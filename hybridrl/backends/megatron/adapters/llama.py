"""Llama: the reference block (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases)."""

from __future__ import annotations

from hybridrl.backends.megatron.adapters.base import DecoderAdapter


class LlamaAdapter(DecoderAdapter):
    """The row `llama` of backends/families.py."""
