"""Qwen2: Llama-style blocks with biases on q/k/v (always), tied embeddings in small models."""

from __future__ import annotations

from hybridrl.backends.megatron.adapters.base import DecoderAdapter


class Qwen2Adapter(DecoderAdapter):
    """The row `qwen2` of backends/families.py."""
