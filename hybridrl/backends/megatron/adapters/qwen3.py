"""Qwen3 and Qwen3-MoE: Llama-style blocks without biases, an RMSNorm over each query and key head
before RoPE (Megatron's qk_layernorm; one head's weights, so never TP-split), and in Qwen3-MoE
sparse layers of routed experts (no shared experts) where `mlp_only_layers` / `decoder_sparse_step`
say so."""

from __future__ import annotations

from hybridrl.backends.megatron.adapters.base import DecoderAdapter


class Qwen3Adapter(DecoderAdapter):
    """The row `qwen3` of backends/families.py."""


class Qwen3MoeAdapter(DecoderAdapter):
    """The row `qwen3_moe` of backends/families.py."""
