"""The engine's weights: fused buffers, their HF-named views, loading and validated in-place updates.

q/k/v projections live in one fused `qkv` matrix per layer and gate/up in one `gate_up` matrix,
so a layer runs two matmuls where HF runs five. `qkv` is [q; k; v] as loaded, or, once it serves a trainer's
fused q/k/v in place (`share_from`), that trainer's layout: for each KV group in turn its query heads, its key
head, its value head (Megatron's), `ModelWeights.qkv_groups` saying which; the model then reorders the
product's columns (`qkv_columns`), never the weights. A sparse layer's experts live in one block, each
expert's gate, up and down matrices side by side (the order a publication sends them), seen as
`w13` [experts, 2I, hidden] and `w2` [experts, hidden, I]. Every HF tensor name maps to a *view* into
those buffers (`hf_views`), so loading a checkpoint and `update_weights` both copy straight into
the existing storage: there is never a second full copy of the model.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from hybridrl.backends.model_spec import ModelSpec

# Names that checkpoints sometimes carry and that the engine recomputes itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor            # [hidden]
    qkv: torch.Tensor                   # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None       # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None         # [head_dim] (Qwen3: RMSNorm of each query head before RoPE)
    k_norm: torch.Tensor | None         # [head_dim]
    o: torch.Tensor                     # [hidden, q_size]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor             # [hidden]
    gate_up: torch.Tensor | None        # [2 * intermediate, hidden]; None in a sparse (MoE) layer
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | None           # [hidden, intermediate]
    down_bias: torch.Tensor | None
    router: torch.Tensor | None = None  # [experts, hidden]: sparse layers only
    experts: torch.Tensor | None = None # [experts, 3 * moe_intermediate * hidden]: per expert gate, up, down
    w13: torch.Tensor | None = None     # [experts, 2 * moe_intermediate, hidden] view: [gate_e; up_e]
    w2: torch.Tensor | None = None      # [experts, hidden, moe_intermediate] view: down_e


def layer_shapes(spec: ModelSpec, i: int) -> list[tuple[str, tuple[int, ...] | None]]:
    """(field, shape) of layer i's tensors in storage order (None: the model has no such tensor)."""
    h, inter, hd = spec.hidden_size, spec.intermediate_size, spec.head_dim
    qkv_rows = spec.q_size + 2 * spec.kv_size
    out = [("input_norm", (h,)), ("qkv", (qkv_rows, h)), ("qkv_bias", (qkv_rows,) if spec.qkv_bias else None),
           ("q_norm", (hd,) if spec.qk_norm else None), ("k_norm", (hd,) if spec.qk_norm else None),
           ("o", (h, spec.q_size)), ("o_bias", (h,) if spec.o_bias else None), ("post_norm", (h,))]
    if spec.moe_index(i) is not None:
        e, mi = spec.num_experts, spec.moe_intermediate_size
        return out + [("router", (e, h)), ("experts", (e, 3 * mi * h))]
    return out + [("gate_up", (2 * inter, h)), ("gate_up_bias", (2 * inter,) if spec.mlp_bias else None),
                  ("down", (h, inter)), ("down_bias", (h,) if spec.mlp_bias else None)]


@dataclass
class ModelWeights:
    embed: torch.Tensor                 # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor                  # [hidden]
    lm_head: torch.Tensor               # [vocab, hidden]; the embedding itself when tied
    flat: torch.Tensor | None = None    # [total]: the one buffer every tensor above is a view of
    qkv_groups: int = 1                 # q/k/v rows as this many groups of [q heads; k heads; v heads]

    @classmethod
    def empty(cls, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device) -> "ModelWeights":
        """Every tensor a view of one flat buffer, laid out in the order a publication sends them
        (embedding; per layer: input norm, q/k/v, their biases, q/k norms, o, post norm, then
        gate/up and down, or the router and each expert's gate, up, down; final norm; LM head),
        so a bucket of consecutive tensors lands with one copy."""
        h = spec.hidden_size
        per_layer = [layer_shapes(spec, i) for i in range(spec.num_layers)]
        shapes = [(spec.vocab_size, h)] + [shape for layer in per_layer for _, shape in layer]
        shapes += [(h,), None if spec.tie_word_embeddings else (spec.vocab_size, h)]
        flat = torch.zeros(sum(torch.Size(s).numel() for s in shapes if s), dtype=dtype, device=device)
        views, offset = [], 0
        for shape in shapes:
            if shape is None:
                views.append(None)
                continue
            n = torch.Size(shape).numel()
            views.append(flat[offset: offset + n].view(shape))
            offset += n
        embed, rest = views[0], iter(views[1:-2])
        layers = []
        for fields in per_layer:
            layer = LayerWeights(**{name: next(rest) for name, _ in fields},
                                 **{k: None for k in ("gate_up", "gate_up_bias", "down", "down_bias")
                                    if k not in dict(fields)})
            if layer.experts is not None:
                layer.w13, layer.w2 = expert_views(layer.experts, spec)
            layers.append(layer)
        norm, lm_head = views[-2], views[-1]
        return cls(embed=embed, layers=layers, norm=norm, lm_head=embed if lm_head is None else lm_head, flat=flat)

    def fields(self) -> list[tuple[object, str]]:
        """(holder, attribute) of every stored tensor: the model's, then each layer's (the expert views
        `w13` / `w2` are derived from `experts`, and a tied head is the embedding)."""
        out: list[tuple[object, str]] = [(self, "embed"), (self, "norm")]
        if self.lm_head is not self.embed:
            out.append((self, "lm_head"))
        for layer in self.layers:
            out += [(layer, name) for name, value in vars(layer).items() if value is not None and name not in ("w13", "w2")]
        return out

    def share_from(self, spec: ModelSpec, source: Mapping[str, torch.Tensor]) -> int:
        """Make every stored tensor whose HF tensors `source` holds, laid out exactly as here (same dtype,
        device, shapes and strides, at this tensor's offsets in one storage), a view of `source`'s storage
        instead of this buffer; the rest move into a new buffer of their own, and the old one is freed once
        nothing else holds it. Returns the bytes now shared. What a trainer in the same process lends
        (`rollout.native.trainer_weights`): its parameters are then the served weights."""
        fields = self.fields()
        groups = spec.num_kv_heads if grouped_qkv_offered(spec, source) else 1
        shared = _adoptions(fields, hf_views(self, spec, qkv_groups=groups), source)
        qkv = [i for i, (_, attr) in enumerate(fields) if attr in ("qkv", "qkv_bias")]
        if groups != self.qkv_groups and not all(i in shared for i in qkv):
            groups = self.qkv_groups                      # q/k/v change layout only all together
            shared = _adoptions(fields, hf_views(self, spec), source)
        if not shared:
            return 0
        own = [field for i, field in enumerate(fields) if i not in shared]
        self.qkv_groups = groups
        for i, adopted in shared.items():
            holder, attr = fields[i]
            setattr(holder, attr, adopted)
        flat = torch.empty(sum(getattr(h, a).numel() for h, a in own), dtype=self.norm.dtype, device=self.norm.device)
        offset = 0
        for holder, attr in own:
            old = getattr(holder, attr)
            setattr(holder, attr, flat[offset: offset + old.numel()].view(old.shape).copy_(old))
            offset += old.numel()
        if self.lm_head is not self.embed and spec.tie_word_embeddings:
            self.lm_head = self.embed
        for layer in self.layers:
            if layer.experts is not None:
                layer.w13, layer.w2 = expert_views(layer.experts, spec)
        self.flat = flat
        return sum(t.numel() * t.element_size() for t in shared.values())

    def num_bytes(self) -> int:
        seen: dict[int, int] = {}
        for t in self.tensors():
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    def tensors(self) -> Iterable[torch.Tensor]:
        yield self.embed
        yield self.norm
        yield self.lm_head
        for layer in self.layers:
            for name, value in vars(layer).items():
                if value is not None and name not in ("w13", "w2"):
                    yield value


def _adoptions(fields: list[tuple[object, str]], views: Mapping[str, torch.Tensor],
               source: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Index in `fields` -> that stored tensor as a view of `source`'s storage, for every field whose HF views
    (`views`, this engine's) `source` lends laid out exactly as they lie in the field (`_lent`)."""
    starts = sorted((getattr(h, a).data_ptr(), i) for i, (h, a) in enumerate(fields))
    members: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, view in views.items():
        i = starts[bisect.bisect_right(starts, (view.data_ptr(), len(fields))) - 1][1]
        members.setdefault(i, []).append((name, view))
    adopted = {i: _lent(getattr(holder, attr), members.get(i, []), source) for i, (holder, attr) in enumerate(fields)}
    return {i: t for i, t in adopted.items() if t is not None}


def _lent(field: torch.Tensor, members: list[tuple[str, torch.Tensor]],
          source: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """`field` as a view of `source`'s storage, where the source's tensors of the field's HF names (`members`:
    name, this engine's view of it) tile it exactly as the engine's views do (same shapes and strides, at the
    same offsets from one base in one storage); else None."""
    if not members or sum(v.numel() for _, v in members) != field.numel() or not field.is_contiguous():
        return None
    size = field.element_size()
    first, base = None, None
    for name, view in members:
        src = source.get(name)
        if (src is None or src.dtype != field.dtype or src.device != field.device or src.shape != view.shape
                or src.stride() != view.stride()):
            return None
        offset = (view.data_ptr() - field.data_ptr()) // size
        if first is None:
            first, base = src, src.storage_offset() - offset
        elif (src.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
              or src.storage_offset() - offset != base):
            return None
    if base < 0:
        return None
    return first.detach().as_strided(field.shape, field.stride(), base)


def grouped_qkv_offered(spec: ModelSpec, source: Mapping[str, torch.Tensor]) -> bool:
    """Whether `source` lends q/k/v in the per-group layout (`ModelSpec.qkv_by_group`'s views; a Megatron
    trainer's)."""
    q = source.get("model.layers.0.self_attn.q_proj.weight")
    return (spec.num_kv_heads > 1 and q is not None and q.dim() == 3
            and tuple(q.shape[:2]) == (spec.num_kv_heads, spec.heads_per_group * spec.head_dim))


def qkv_columns(spec: ModelSpec) -> torch.Tensor:
    """Column indices that reorder a product whose q/k/v rows run per KV group (`ModelSpec.qkv_by_group`)
    into [q; k; v]: that layout's q, k and v read off the row numbers."""
    rows = torch.arange(spec.q_size + 2 * spec.kv_size)
    return torch.cat([part.reshape(-1) for part in spec.qkv_by_group(rows)])


def expert_views(experts: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The [experts, 3 * I * hidden] block as w13 [experts, 2I, hidden] (gate rows, then up rows) and
    w2 [experts, hidden, I] (down): strided views, each expert's matrices contiguous."""
    e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    stride = 3 * i * h
    w13 = experts.as_strided((e, 2 * i, h), (stride, h, 1))
    w2 = experts.as_strided((e, h, i), (stride, i, 1), experts.storage_offset() + 2 * i * h)
    return w13, w2


def hf_views(weights: ModelWeights, spec: ModelSpec, *, qkv_groups: int | None = None) -> dict[str, torch.Tensor]:
    """HF parameter name -> a view into the engine's storage with the HF shape; q/k/v stored per KV group
    (`qkv_groups` > 1, by default the weights' own) are [groups, rows per group, *rest] views instead, their
    elements in the HF tensor's order (`ModelSpec.qkv_by_group`)."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    groups = weights.qkv_groups if qkv_groups is None else qkv_groups
    views = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm}
    if not spec.tie_word_embeddings:
        views["lm_head.weight"] = weights.lm_head
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        views[p + "input_layernorm.weight"] = layer.input_norm
        views[p + "post_attention_layernorm.weight"] = layer.post_norm
        for kind, fused in (("weight", layer.qkv), ("bias", layer.qkv_bias)):
            if fused is None:
                continue
            parts = (spec.qkv_by_group(fused) if groups > 1
                     else (fused[:q], fused[q: q + kv], fused[q + kv: q + 2 * kv]))
            for name, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                views[p + f"self_attn.{name}.{kind}"] = part
        if layer.q_norm is not None:
            views[p + "self_attn.q_norm.weight"] = layer.q_norm
            views[p + "self_attn.k_norm.weight"] = layer.k_norm
        views[p + "self_attn.o_proj.weight"] = layer.o
        if layer.o_bias is not None:
            views[p + "self_attn.o_proj.bias"] = layer.o_bias
        if layer.router is not None:
            mi = spec.moe_intermediate_size
            views[p + "mlp.gate.weight"] = layer.router
            for e in range(spec.num_experts):
                views[p + f"mlp.experts.{e}.gate_proj.weight"] = layer.w13[e, :mi]
                views[p + f"mlp.experts.{e}.up_proj.weight"] = layer.w13[e, mi:]
                views[p + f"mlp.experts.{e}.down_proj.weight"] = layer.w2[e]
            continue
        for name, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            views[p + f"mlp.{name}.weight"] = layer.gate_up[rows]
            if layer.gate_up_bias is not None:
                views[p + f"mlp.{name}.bias"] = layer.gate_up_bias[rows]
        views[p + "mlp.down_proj.weight"] = layer.down
        if layer.down_bias is not None:
            views[p + "mlp.down_proj.bias"] = layer.down_bias
    return views


def load_checkpoint(model_dir: str | Path, views: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    """Copy every tensor of the directory's *.safetensors into its view (dtype cast allowed here)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    missing = set(views)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and spec.tie_word_embeddings:
                    continue  # some checkpoints store the tied head too
                if name not in views:
                    raise ValueError(f"{path.name}: tensor {name!r} is not a parameter of a {spec.arch} model "
                                     f"with this config")
                tensor = f.get_tensor(name)
                target = views[name]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, the config "
                                     f"implies {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor)
                missing.discard(name)
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} tensor(s), e.g. {sorted(missing)[0]!r}")
