"""The Qwen2 / Llama / Qwen3 / Qwen3-MoE forward pass over a flat batch of tokens with a paged KV cache.

A step's tokens from every scheduled sequence are concatenated ("flat": [N, hidden]), so the
linear layers run once for decodes and prefill chunks together with no padding. Only attention
looks at sequences: decode tokens first (one query each), then the prefill chunks (see
`attention.py`). Numerics follow transformers: fp32 RMSNorm (also over each q/k head in Qwen3),
rotate-half RoPE with float32 cos/sin, softmax(q k^T / sqrt(head_dim)), SiLU-gated MLP.

Sparse (MoE) layers route every token of the step at once (softmax over the experts in float32,
top-k, optionally renormalised, as transformers' Qwen3MoeTopKRouter), then run each expert that
received tokens once on all of them, so the step's cost is one matmul pair per used expert
whatever the number of sequences. The chosen expert ids of every token are written to the
routing cache, in the token's KV slot (`routing` [moe_layers, slots, top_k]): a sequence's record
lives beside its KV blocks, so prefix-cache hits carry the routing of the tokens they share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.backends.native import cpu_kernels
from hybridrl.backends.native.attention import AttentionMetadata, paged_attention, write_kv
from hybridrl.backends.model_spec import ModelSpec
from hybridrl.backends.native.lora import LoraWeights, add_low_rank_
from hybridrl.backends.native.weights import ModelWeights, qkv_columns


class RotaryTable:
    """cos and sin of every position side by side, [max_len, 2, head_dim // 2], float32 as transformers
    computes them (float32 position * inv_freq, then cos / sin)."""

    def __init__(self, spec: ModelSpec, max_len: int, device: torch.device):
        inv_freq = spec.inv_freq()
        freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.table = torch.stack([freqs.cos(), freqs.sin()], dim=1).to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at positions [N], each [N, 1, head_dim // 2]."""
        rows = self.table.index_select(0, positions)
        if rows.dtype != dtype:
            rows = rows.to(dtype)
        rows = rows.unsqueeze(2)                                             # [N, 2, 1, head_dim // 2]
        return rows[:, 0], rows[:, 1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the statistics in float32 (transformers' Qwen2RMSNorm / LlamaRMSNorm).

    `F.rms_norm` (same numbers) is quicker on small inputs, but its CPU path in torch 2.13 copies its
    input twice, which costs more than the written-out form on large ones (prefill)."""
    if x.dtype == torch.float32:
        if x.numel() <= 32768:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on qk [N, heads, head_dim]; cos/sin [N, 1, head_dim // 2].

    x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (transformers' q * cos + rotate_half(q) * sin)."""
    half = qk.shape[-1] // 2
    x1, x2 = qk[..., :half], qk[..., half:]
    x1_sin = x1 * sin
    x1.mul_(cos).sub_(x2 * sin)
    x2.mul_(cos).add_(x1_sin)


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] in h's dtype, expert ids [N, k] long): softmax over all experts in float32,
    the top k, renormalised to sum to 1 when `normalise` (transformers' Qwen3MoeTopKRouter)."""
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), ids


def moe_mlp(h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
            w2: torch.Tensor) -> torch.Tensor:
    """sum_k weights[n, k] * expert_{ids[n, k]}(h[n]) for h [N, hidden]: tokens grouped by expert, each
    used expert's SwiGLU run once on its tokens, the weighted outputs added back in expert order."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)                       # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    token = order // k
    rows = h.index_select(0, token)
    outs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            gate, up = F.linear(rows[start: start + count], w13[expert]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w2[expert]))
            start += count
    y = torch.cat(outs) * weights.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(h).index_add_(0, token, y)


def residual_linear(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + h @ weight.T (+ bias), the residual add done by the matmul itself (one op instead of two)."""
    if bias is not None:
        return x + F.linear(h, weight, bias)
    return torch.addmm(x, h, weight.t())


class CausalLM:
    """Inference-only Qwen2 / Llama / Qwen3 / Qwen3-MoE. `forward` returns float32 logits of the selected rows.
    With `lora`, each targeted fused linear adds its adapters' scale * B A x (`lora.py`). With `kernels`
    (CPU, float32), RMSNorm, RoPE with the KV write, SiLU-and-multiply, and the linear layers of steps
    of few rows (decode steps; `linear`) run as the C kernels of `cpu_kernels.py`
    instead of torch operators (the same arithmetic up to the order of sums, one pass each)."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, rotary: RotaryTable, lora: LoraWeights | None = None,
                 kernels: cpu_kernels.Kernels | None = None):
        self.spec = spec
        self.weights = weights
        self.rotary = rotary
        self.lora = lora
        self.kernels = kernels
        self.scale = spec.head_dim ** -0.5
        self._columns: torch.Tensor | None = None      # `qkv_columns`, once the weights are per KV group

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return cpu_kernels.rms_norm(x, weight, self.spec.rms_norm_eps, self.kernels)
        return rms_norm(x, weight, self.spec.rms_norm_eps)

    def linear(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """(residual +) h @ weight.T (+ bias): the C kernel for a decode step's few rows times a weight too large
        for the cache (`cpu_kernels.LINEAR_ROWS`, `LINEAR_MIN_WEIGHTS`), BLAS otherwise."""
        if (self.kernels is not None and h.shape[0] <= cpu_kernels.LINEAR_ROWS
                and weight.numel() >= cpu_kernels.LINEAR_MIN_WEIGHTS and h.stride(1) == 1
                and weight.is_contiguous() and (residual is None or residual.is_contiguous())):
            return cpu_kernels.linear(h, weight, bias, residual, self.kernels)
        if residual is not None:
            return residual_linear(residual, h, weight, bias)
        return F.linear(h, weight, bias)

    def qkv_columns(self, device: torch.device) -> torch.Tensor:
        if self._columns is None:
            self._columns = qkv_columns(self.spec).to(device)
        return self._columns

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, logits_rows: torch.Tensor, routing: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N]; kv_cache [layers, blocks, block_size, 2, kv_heads, head_dim];
        logits_rows [S] (flat rows whose next-token logits are needed) -> logits [S, vocab] float32.
        routing [moe_layers, blocks * block_size, top_k] (MoE models): each token's expert ids are
        written at its KV slot."""
        spec, w, kernels = self.spec, self.weights, self.kernels
        n = input_ids.shape[0]
        q_size, kv_size, hd = spec.q_size, spec.kv_size, spec.head_dim
        heads = spec.num_heads + spec.num_kv_heads
        if kernels is None:
            cos, sin = self.rotary.lookup(positions, w.embed.dtype)
        x = F.embedding(input_ids, w.embed)                                    # [N, hidden]
        moe = 0
        no_adapters: dict = {}
        for i, layer in enumerate(w.layers):
            ad = self.lora.layers[i] if self.lora is not None else no_adapters
            s = self.lora.scale if self.lora is not None else 0.0
            h = self.norm(x, layer.input_norm)
            qkv = add_low_rank_(self.linear(h, layer.qkv, layer.qkv_bias), h, ad.get("qkv"), s)   # [N, q + 2 kv]
            if w.qkv_groups > 1:             # rows a trainer lends per KV group: its product's columns to [q; k; v]
                qkv = qkv.index_select(1, self.qkv_columns(qkv.device))
            qk = qkv[:, : q_size + kv_size].view(n, heads, hd)
            if layer.q_norm is not None:                                       # Qwen3: per-head RMSNorm
                qk[:, : spec.num_heads] = rms_norm(qk[:, : spec.num_heads], layer.q_norm, spec.rms_norm_eps)
                qk[:, spec.num_heads:] = rms_norm(qk[:, spec.num_heads:], layer.k_norm, spec.rms_norm_eps)
            q = qkv[:, :q_size].view(n, spec.num_heads, hd)
            kv = qkv[:, q_size:].view(n, 2, spec.num_kv_heads, hd)
            if kernels is not None:
                cpu_kernels.rope_store(qkv, self.rotary.table, positions, meta.slot_mapping, kv_cache[i],
                                       spec.num_heads, spec.num_kv_heads, hd, kernels)
            else:
                apply_rotary_(qk, cos, sin)
                write_kv(kv_cache[i], kv, meta.slot_mapping)
            attn = paged_attention(q, kv, kv_cache[i], meta, self.scale)          # [N, q_size]
            x = add_low_rank_(self.linear(attn, layer.o, layer.o_bias, residual=x), attn, ad.get("o"), s)
            h = self.norm(x, layer.post_norm)
            if layer.router is not None:
                weights, ids = route(h, layer.router, spec.num_experts_per_tok, spec.norm_topk_prob)
                if routing is not None:
                    routing[moe].index_copy_(0, meta.slot_mapping, ids.to(routing.dtype))
                moe += 1
                x = x + moe_mlp(h, weights, ids, layer.w13, layer.w2)
                continue
            gate_up = add_low_rank_(self.linear(h, layer.gate_up, layer.gate_up_bias), h, ad.get("gate_up"), s)
            if kernels is not None:
                act = cpu_kernels.silu_mul(gate_up, kernels)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            x = add_low_rank_(self.linear(act, layer.down, layer.down_bias, residual=x), act, ad.get("down"), s)
        if logits_rows.numel() == 0:
            return x.new_empty((0, spec.vocab_size), dtype=torch.float32)
        h = self.norm(x.index_select(0, logits_rows), w.norm)
        return self.linear(h, w.lm_head).float()
