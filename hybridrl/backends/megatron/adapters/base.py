"""The HF <-> Megatron map for decoder-only transformers (Llama-style blocks), as data.

A model is a list of `Slot`s: one per Megatron parameter, located structurally (a role and a
global layer index, never a parameter-name substring), each naming the HF tensors it holds and
how tensor parallelism splits it. `DecoderAdapter.from_hf` builds one TP rank's shard of a slot
from full HF tensors; `to_hf` rebuilds the full HF tensors from every TP rank's shard. Both are
pure tensor indexing (no arithmetic), so HF -> Megatron -> HF is bitwise exact.

Layouts (Megatron-core's GPTModel with the local layer spec, checked bitwise against transformers):
  linear_qkv   for each KV group in turn: its query heads, its key head, its value head;
               TP splits dim 0 by whole groups (kv_heads % tp == 0). Biases the same way.
  linear_fc1   on each TP rank: [that rank's gate slice; that rank's up slice].
  linear_proj, linear_fc2   row-parallel: split along dim 1.
  embedding, output_layer   vocab rows, padded with zeros to `padded_vocab_size`, split dim 0.
  norms        replicated; q_layernorm / k_layernorm (Qwen3) act on one head's head_dim, so they
               are replicated too (never TP-split).
  MoE layers   router.weight [experts, hidden] replicated; expert e lives on expert-parallel rank
               e // (experts / ep) as local expert e % (experts / ep); its linear_fc1 / linear_fc2
               are split over the expert-tensor-parallel group like the dense MLP's.

Publication groups (`groups`): one slot each, except that an expert's fc1 and fc2 form one group
(its gate, up and down tensors), so a bucket never holds part of an expert.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from hybridrl.backends.model_spec import ModelSpec


class Role(enum.Enum):
    EMBEDDING = "embedding"
    INPUT_NORM = "input_norm"
    QKV_WEIGHT = "qkv_weight"
    QKV_BIAS = "qkv_bias"
    PROJ_WEIGHT = "proj_weight"
    MLP_NORM = "mlp_norm"
    FC1_WEIGHT = "fc1_weight"
    FC2_WEIGHT = "fc2_weight"
    FINAL_NORM = "final_norm"
    OUTPUT = "output"
    Q_NORM = "q_norm"
    K_NORM = "k_norm"
    ROUTER = "router"
    EXPERT_FC1 = "expert_fc1"
    EXPERT_FC2 = "expert_fc2"


class Split(enum.Enum):
    NONE = "none"          # replicated on every TP rank
    COLUMN = "column"      # dim 0 (plain chunks)
    ROW = "row"            # dim 1
    VOCAB = "vocab"        # dim 0, padded to the padded vocabulary first
    QKV = "qkv"            # dim 0 by whole KV groups, after interleaving q/k/v per group
    GATE_UP = "gate_up"    # dim 0, each rank [gate_r; up_r]


_SPLIT_OF = {
    Role.EMBEDDING: Split.VOCAB, Role.OUTPUT: Split.VOCAB,
    Role.INPUT_NORM: Split.NONE, Role.MLP_NORM: Split.NONE, Role.FINAL_NORM: Split.NONE,
    Role.QKV_WEIGHT: Split.QKV, Role.QKV_BIAS: Split.QKV,
    Role.PROJ_WEIGHT: Split.ROW, Role.FC2_WEIGHT: Split.ROW, Role.FC1_WEIGHT: Split.GATE_UP,
    Role.Q_NORM: Split.NONE, Role.K_NORM: Split.NONE, Role.ROUTER: Split.NONE,
    Role.EXPERT_FC1: Split.GATE_UP, Role.EXPERT_FC2: Split.ROW,
}


@dataclass(frozen=True)
class Slot:
    """One Megatron parameter: its role, global layer index (None outside the layers), HF names,
    and for an expert's weights the expert's global index."""

    role: Role
    layer: int | None
    hf_names: tuple[str, ...]
    exported: bool = True     # False: a copy of another slot's tensor (tied output layer)
    expert: int | None = None

    @property
    def split(self) -> Split:
        return _SPLIT_OF[self.role]

    def __str__(self) -> str:
        where = f"layer {self.layer} " if self.layer is not None else ""
        which = f" of expert {self.expert}" if self.expert is not None else ""
        return f"{where}{self.role.value}{which}"


class DecoderAdapter:
    """HF Llama-style naming and Megatron GPTModel layouts over a `ModelSpec`. Families subclass
    `check_spec` for what they cannot express."""

    def __init__(self, spec: ModelSpec, *, tp: int = 1, ep: int = 1, vocab_divisible_by: int = 128):
        self.check_spec(spec)
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(f"{spec.num_heads} attention heads do not divide into {spec.num_kv_heads} KV groups")
        if spec.num_kv_heads % tp:
            raise ValueError(f"tp={tp} must divide the number of KV heads ({spec.num_kv_heads}): "
                             "Megatron splits the fused QKV by whole query groups")
        if spec.intermediate_size % tp or spec.num_heads % tp:
            raise ValueError(f"tp={tp} must divide the FFN size ({spec.intermediate_size}) and the heads "
                             f"({spec.num_heads})")
        if ep > 1 and not spec.is_moe:
            raise ValueError(f"ep={ep}: expert parallelism needs a mixture-of-experts model ({spec.arch} is dense)")
        if spec.is_moe and (spec.num_experts % ep or spec.moe_intermediate_size % tp):
            raise ValueError(f"ep={ep} must divide the {spec.num_experts} experts and tp={tp} their FFN size "
                             f"({spec.moe_intermediate_size})")
        self.spec = spec
        self.tp = tp
        self.ep = ep
        self.etp = tp               # experts are TP-split like the dense MLP (expert_tensor_parallel_size = tp)
        self.padded_vocab_size = spec.padded_vocab_size(tp, vocab_divisible_by)
        self._slots: list[Slot] | None = None          # slots(), computed on first use
        self._groups: list | None = None               # its groups, computed on first use

    @property
    def family(self) -> str:
        """The model family's name (its row in backends/families.py; several may share one adapter class)."""
        return self.spec.arch

    @property
    def experts_per_rank(self) -> int:
        return self.spec.num_experts // self.ep

    def tp_of(self, slot: Slot) -> int:
        """How many shards the slot has: the expert-TP size for experts' weights, else the TP size."""
        return self.etp if slot.expert is not None else self.tp

    def ep_owner(self, slot: Slot) -> int | None:
        """The expert-parallel rank that holds an expert's slot (None for every other slot)."""
        return None if slot.expert is None else slot.expert // self.experts_per_rank

    @classmethod
    def check_spec(cls, spec: ModelSpec) -> None:
        """Raise a clear error for what Megatron's GPTModel (as we build it) cannot express."""
        # Megatron has a q/k/v-only bias (add_qkv_bias) and an all-linear bias (add_bias_linear);
        # an o_proj bias without MLP biases (Llama's attention_bias), or MLP biases, do not map.
        if spec.o_bias:
            raise ValueError(f"{spec.arch}: attention_bias=True is unsupported (o_proj bias has no Megatron slot)")
        if spec.mlp_bias:
            raise ValueError(f"{spec.arch}: mlp_bias=True is unsupported")

    # ----------------------------------------------------------------- slots

    def slots(self) -> list[Slot]:
        """Every Megatron parameter of the whole model, in model order (embedding, layers, norm, output).
        (Computed once: a large MoE model has tens of thousands; do not modify the list.)"""
        if self._slots is None:
            self._slots = self._all_slots()
        return self._slots

    def _all_slots(self) -> list[Slot]:
        out = [Slot(Role.EMBEDDING, None, ("model.embed_tokens.weight",))]
        for i in range(self.spec.num_layers):
            out += self.layer_slots(i)
        out.append(Slot(Role.FINAL_NORM, None, ("model.norm.weight",)))
        if self.spec.tie_word_embeddings:
            out.append(Slot(Role.OUTPUT, None, ("model.embed_tokens.weight",), exported=False))
        else:
            out.append(Slot(Role.OUTPUT, None, ("lm_head.weight",)))
        return out

    def layer_slots(self, i: int) -> list[Slot]:
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        slots = [
            Slot(Role.INPUT_NORM, i, (p + "input_layernorm.weight",)),
            Slot(Role.QKV_WEIGHT, i, tuple(f"{attn}{x}_proj.weight" for x in "qkv")),
        ]
        if self.spec.qkv_bias:
            slots.append(Slot(Role.QKV_BIAS, i, tuple(f"{attn}{x}_proj.bias" for x in "qkv")))
        if self.spec.qk_norm:
            slots += [Slot(Role.Q_NORM, i, (attn + "q_norm.weight",)), Slot(Role.K_NORM, i, (attn + "k_norm.weight",))]
        slots += [
            Slot(Role.PROJ_WEIGHT, i, (attn + "o_proj.weight",)),
            Slot(Role.MLP_NORM, i, (p + "post_attention_layernorm.weight",)),
        ]
        if self.spec.moe_index(i) is None:
            return slots + [Slot(Role.FC1_WEIGHT, i, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                            Slot(Role.FC2_WEIGHT, i, (p + "mlp.down_proj.weight",))]
        slots.append(Slot(Role.ROUTER, i, (p + "mlp.gate.weight",)))
        for e in range(self.spec.num_experts):
            ex = f"{p}mlp.experts.{e}."
            slots += [Slot(Role.EXPERT_FC1, i, (ex + "gate_proj.weight", ex + "up_proj.weight"), expert=e),
                      Slot(Role.EXPERT_FC2, i, (ex + "down_proj.weight",), expert=e)]
        return slots

    def groups(self) -> list[list[Slot]]:
        """The exported slots in model order, as publication groups: one slot each, an expert's fc1
        and fc2 together (a bucket holds whole experts). Computed once."""
        if self._groups is not None:
            return self._groups
        out: list[list[Slot]] = []
        for slot in self.slots():
            if not slot.exported:
                continue
            if slot.role is Role.EXPERT_FC2 and out and out[-1][0].expert == slot.expert:
                out[-1].append(slot)
            else:
                out.append([slot])
        self._groups = out
        return out

    def hf_names(self) -> list[str]:
        """The HF state-dict names this model exports, sorted (the canonical order)."""
        return sorted(n for s in self.slots() if s.exported for n in s.hf_names)

    # ----------------------------------------------------------------- Megatron modules (structural)

    @staticmethod
    def megatron_param(chunk: Any, slot: Slot, layers: Mapping[int, Any]) -> torch.nn.Parameter | None:
        """The parameter of `slot` in a GPTModel chunk, or None when this stage does not hold it.

        `layers` maps global layer index -> this chunk's TransformerLayer (local spec modules)."""
        role = slot.role
        if role is Role.EMBEDDING:
            return chunk.embedding.word_embeddings.weight if chunk.pre_process else None
        if role is Role.FINAL_NORM:
            return chunk.decoder.final_layernorm.weight if chunk.post_process else None
        if role is Role.OUTPUT:
            return chunk.output_layer.weight if chunk.post_process else None   # None when tied on one stage
        layer = layers.get(slot.layer)
        if layer is None:
            return None
        if role is Role.INPUT_NORM:
            return layer.input_layernorm.weight
        if role is Role.QKV_WEIGHT:
            return layer.self_attention.linear_qkv.weight
        if role is Role.QKV_BIAS:
            return layer.self_attention.linear_qkv.bias
        if role is Role.PROJ_WEIGHT:
            return layer.self_attention.linear_proj.weight
        if role is Role.MLP_NORM:
            return layer.pre_mlp_layernorm.weight
        if role is Role.Q_NORM:
            return layer.self_attention.q_layernorm.weight
        if role is Role.K_NORM:
            return layer.self_attention.k_layernorm.weight
        if role is Role.ROUTER:
            return layer.mlp.router.weight
        if role in (Role.EXPERT_FC1, Role.EXPERT_FC2):
            local = layer.mlp.local_expert_indices
            if slot.expert not in local:
                return None                                     # another expert-parallel rank holds it
            expert = layer.mlp.experts.local_experts[local.index(slot.expert)]
            return (expert.linear_fc1 if role is Role.EXPERT_FC1 else expert.linear_fc2).weight
        if role is Role.FC1_WEIGHT:
            return layer.mlp.linear_fc1.weight
        if role is Role.FC2_WEIGHT:
            return layer.mlp.linear_fc2.weight
        raise AssertionError(f"unhandled role {role}")

    # ----------------------------------------------------------------- conversions

    def from_hf(self, slot: Slot, hf: Mapping[str, torch.Tensor], tp_rank: int) -> torch.Tensor:
        """TP rank `tp_rank`'s shard of `slot`, built from full HF tensors (`hf[name]` for its names)."""
        tensors = [hf[n] for n in slot.hf_names]
        split, tp = slot.split, self.tp_of(slot)
        if split is Split.NONE:
            return tensors[0].clone()
        if split is Split.VOCAB:
            full = tensors[0]
            padded = full.new_zeros((self.padded_vocab_size, *full.shape[1:]))
            padded[: full.shape[0]] = full
            return padded.chunk(tp, dim=0)[tp_rank].clone()
        if split is Split.COLUMN:
            return tensors[0].chunk(tp, dim=0)[tp_rank].clone()
        if split is Split.ROW:
            return tensors[0].chunk(tp, dim=1)[tp_rank].clone()
        if split is Split.QKV:
            return self._fuse_qkv(*tensors).chunk(tp, dim=0)[tp_rank].clone()
        if split is Split.GATE_UP:
            gate, up = (t.chunk(tp, dim=0)[tp_rank] for t in tensors)
            return torch.cat([gate, up], dim=0)
        raise AssertionError(f"unhandled split {split}")

    def to_hf(self, slot: Slot, shards: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The full HF tensors of `slot` from every TP rank's shard (in TP rank order)."""
        if len(shards) != (1 if slot.split is Split.NONE else self.tp_of(slot)):
            raise ValueError(f"{slot}: expected {self.tp_of(slot)} TP shards, got {len(shards)}")
        split, names = slot.split, slot.hf_names
        if split is Split.NONE:
            return {names[0]: shards[0]}
        if split is Split.VOCAB:
            return {names[0]: _join(shards, 0)[: self.spec.vocab_size]}
        if split is Split.COLUMN:
            return {names[0]: _join(shards, 0)}
        if split is Split.ROW:
            return {names[0]: _join(shards, 1)}
        if split is Split.QKV:
            return dict(zip(names, self._unfuse_qkv(_join(shards, 0))))
        if split is Split.GATE_UP:
            halves = [s.chunk(2, dim=0) for s in shards]
            return {names[0]: _join([h[0] for h in halves], 0), names[1]: _join([h[1] for h in halves], 0)}
        raise AssertionError(f"unhandled split {split}")

    def write_hf(self, slot: Slot, shards: Sequence[torch.Tensor], out: Mapping[str, torch.Tensor]) -> None:
        """`to_hf` written straight into the caller's contiguous tensors `out[name]` (a publication's
        flat bucket): shards are copied (and q/k/v un-fused) into place, no HF tensor is built."""
        split, names, s = slot.split, slot.hf_names, self.spec
        if split is Split.NONE:
            out[names[0]].copy_(shards[0])
        elif split in (Split.VOCAB, Split.COLUMN):      # dim 0 in rank order; the vocabulary padding dropped
            dst, row = out[names[0]], 0
            for shard in shards:
                n = min(shard.shape[0], dst.shape[0] - row)
                dst[row: row + n].copy_(shard[:n])
                row += n
        elif split is Split.ROW:
            dst, col = out[names[0]], 0
            for shard in shards:
                dst[:, col: col + shard.shape[1]].copy_(shard)
                col += shard.shape[1]
        elif split is Split.QKV:                          # each shard holds whole KV groups: [q..., k, v] each
            q_rows = s.heads_per_group * s.head_dim
            tail = shards[0].shape[1:]                  # (hidden,) or (): out[name] may be a [groups, rows, ...] view
            q, k, v = (out[n].view(s.num_kv_heads, -1, *tail) for n in names)
            group = 0
            for shard in shards:
                grouped = shard.reshape(-1, q_rows + 2 * s.head_dim, *tail)
                g = slice(group, group + grouped.shape[0])
                _copy(q[g], grouped[:, :q_rows])
                _copy(k[g], grouped[:, q_rows: q_rows + s.head_dim])
                _copy(v[g], grouped[:, q_rows + s.head_dim:])
                group += grouped.shape[0]
        elif split is Split.GATE_UP:                      # each shard is [gate_r; up_r]
            row = 0
            for shard in shards:
                gate, up = shard.chunk(2, dim=0)
                out[names[0]][row: row + gate.shape[0]].copy_(gate)
                out[names[1]][row: row + up.shape[0]].copy_(up)
                row += gate.shape[0]
        else:
            raise AssertionError(f"unhandled split {split}")

    def _fuse_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = self.spec
        tail = q.shape[1:]                                         # (hidden,) for weights, () for biases
        q = q.reshape(s.num_kv_heads, s.heads_per_group * s.head_dim, *tail)
        k = k.reshape(s.num_kv_heads, s.head_dim, *tail)
        v = v.reshape(s.num_kv_heads, s.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)    # [groups * (qpg + 2) * head_dim, ...]

    def grouped_qkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v of a whole fused q/k/v weight or bias as views of it (`ModelSpec.qkv_by_group`); with one KV
        group, views in the HF shape."""
        parts = self.spec.qkv_by_group(fused)
        return tuple(p[0] for p in parts) if self.spec.num_kv_heads == 1 else parts

    def _unfuse_qkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tail = fused.shape[1:]
        return tuple(p.reshape(-1, *tail) for p in self.spec.qkv_by_group(fused.contiguous()))

    # ----------------------------------------------------------------- whole state dicts (offline)

    def shard_state_dict(self, hf: Mapping[str, torch.Tensor], tp_rank: int) -> dict[Slot, torch.Tensor]:
        """Every slot's shard for one TP rank (all layers and experts; for tests and offline conversion)."""
        return {slot: self.from_hf(slot, hf, tp_rank) for slot in self.slots() if tp_rank < self.tp_of(slot)}

    def merge_state_dicts(self, shards: Sequence[Mapping[Slot, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The HF state dict from every TP rank's `shard_state_dict` (exported names only)."""
        out: dict[str, torch.Tensor] = {}
        for slot in self.slots():
            if slot.exported:
                parts = [shards[0][slot]] if slot.split is Split.NONE else [s[slot] for s in shards[:self.tp_of(slot)]]
                out.update(self.to_hf(slot, parts))
        return out

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """The full shape of every exported HF tensor."""
        s = self.spec
        q, kv, h, f = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.hidden_size, s.intermediate_size
        mf = s.moe_intermediate_size
        by_role = {
            Role.EMBEDDING: [(s.vocab_size, h)], Role.OUTPUT: [(s.vocab_size, h)],
            Role.INPUT_NORM: [(h,)], Role.MLP_NORM: [(h,)], Role.FINAL_NORM: [(h,)],
            Role.QKV_WEIGHT: [(q, h), (kv, h), (kv, h)], Role.QKV_BIAS: [(q,), (kv,), (kv,)],
            Role.PROJ_WEIGHT: [(h, q)], Role.FC1_WEIGHT: [(f, h), (f, h)], Role.FC2_WEIGHT: [(h, f)],
            Role.Q_NORM: [(s.head_dim,)], Role.K_NORM: [(s.head_dim,)], Role.ROUTER: [(s.num_experts, h)],
            Role.EXPERT_FC1: [(mf, h), (mf, h)], Role.EXPERT_FC2: [(h, mf)],
        }
        return {n: shape for slot in self.slots() if slot.exported
                for n, shape in zip(slot.hf_names, by_role[slot.role])}

    def slot_of_hf_name(self) -> dict[str, Slot]:
        """HF name -> the exported slot that holds it."""
        return {n: s for s in self.slots() if s.exported for n in s.hf_names}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), nothing where both are the same elements of one storage (an engine serving the
    parameter in place lends views of it: un-fusing it onto them writes nothing), which torch would take
    for an overlapping copy where a dimension of one element has another stride."""
    if (dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() and dst.shape == src.shape
            and dst.dtype == src.dtype
            and dst.storage_offset() == src.storage_offset()
            and all(a == b for a, b, n in zip(dst.stride(), src.stride(), dst.shape) if n > 1)):
        return
    dst.copy_(src)


def _join(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """Concatenate TP shards; a single shard is returned as it is (a view: no copy at TP=1)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim=dim)
