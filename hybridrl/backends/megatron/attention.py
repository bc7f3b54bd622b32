"""Core attention through `torch.nn.functional.scaled_dot_product_attention`.

A drop-in for megatron's local `DotProductAttention` in the layer spec (same constructor and
forward signature). Megatron's version materialises the [b, heads, s, s] scores and repeats the
KV heads for grouped-query attention; SDPA picks a fused kernel (flash / memory-efficient on
GPU, flash on CPU) and handles GQA natively. Causal self-attention only, which is all the
engine runs (right-padded sequences: padding never precedes a real token).

Packed sequences (Megatron's `thd` format, `schedule.PackedSequences`): query/key/value arrive as
[tokens, heads, d] and attention must not cross a sequence boundary. The pack's sequences are
attended in groups of similar length: each group gathered into a padded [n, heads, L, d] block,
one causal SDPA call, the real positions put back in pack order. (Measured on CPU against one
SDPA call with a block-diagonal causal mask and against one call per sequence: see
docs/megatron.md.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hybridrl.backends.megatron import upstream  # noqa: F401  (megatron-core imported first, there)
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


_NATIVE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)   # enable_gqa=


class SDPAttention(MegatronModule):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        if attn_mask_type is not AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal self-attention only, not {attn_mask_type}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp                 # per TP rank
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, heads, d], key/value [sk, b, groups, d] -> context [sq, b, heads * d];
        packed (`thd`): query [t, heads, d], key/value [t, groups, d] -> [t, heads * d].

        `attention_mask` is ignored: attention is causal by construction."""
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        sq, b = query.shape[0], query.shape[1]
        if key.shape[0] != sq:
            raise ValueError(f"causal self-attention expects equal query/key lengths, got {sq} and {key.shape[0]}")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))   # [b, heads|groups, s, d]
        context = self._sdpa(q, k, v)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)   # [sq, b, hp]

    def _packed(self, query, key, value, params):
        groups = getattr(params, "groups", None)
        if params.qkv_format != "thd" or not groups:
            raise ValueError("SDPAttention takes packed sequences as built by hybridrl's schedule "
                             "(schedule.PackedSequences, qkv_format='thd')")
        t = query.shape[0]
        outputs = []
        # index_select rather than advanced indexing: its backward is index_add_, several times
        # faster on CPU than the accumulating index_put_ of x[index]
        for index, valid in groups:
            n, length = index.shape
            q, k, v = (x.index_select(0, index.reshape(-1)).view(n, length, *x.shape[1:]).permute(0, 2, 1, 3)
                       for x in (query, key, value))                                # [n, heads|groups, L, d]
            context = self._sdpa(q, k, v).permute(0, 2, 1, 3)                       # [n, L, heads, d]
            outputs.append(context.reshape(-1, self.heads * self.head_dim).index_select(0, valid))
        context = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        if context.shape[0] != t:
            raise ValueError(f"packed attention: the groups cover {context.shape[0]} positions, the pack holds {t}")
        return context.index_select(0, params.inverse)

    def _sdpa(self, q, k, v):
        kwargs = {"is_causal": True, "scale": self.scale}
        if self.groups != self.heads:
            if _NATIVE_GQA:
                kwargs["enable_gqa"] = True
            else:
                k = k.repeat_interleave(self.heads // self.groups, dim=1)
                v = v.repeat_interleave(self.heads // self.groups, dim=1)
        dropout = self.dropout if self.training else 0.0
        if q.device.type == "cpu" and q.dtype is not torch.float32:
            # torch's CPU flash attention in bfloat16 / float16 (2.13) runs 2.5x slower than in float32 for the
            # forward and backward of a pack's group (12 heads, 56 positions, head_dim 64: 5.3 ms against 2.1
            # including the casts); the softmax is computed in float32 either way
            return self._sdpa_call(q.float(), k.float(), v.float(), dropout, kwargs).to(q.dtype)
        return self._sdpa_call(q, k, v, dropout, kwargs)

    def _sdpa_call(self, q, k, v, dropout, kwargs):
        if dropout > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **kwargs)
        else:
            context = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return context
