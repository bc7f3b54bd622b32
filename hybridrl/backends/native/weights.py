"""The engine's weights: fused buffers, their HF-named views, loading and validated in-place updates.

q/k/v projections live in one fused `qkv` matrix per layer and gate/up in one `gate_up` matrix,
so a layer runs two matmuls where HF runs five. Every HF tensor name maps to a *view* into
those buffers (`hf_views`), so loading a checkpoint and `update_weights` both copy straight into
the existing storage: there is never a second full copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from hybridrl.backends.model_spec import ModelSpec

# Names that checkpoints sometimes carry and that the engine recomputes itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor            # [hidden]
    qkv: torch.Tensor                   # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None       # [q_size + 2 * kv_size]
    o: torch.Tensor                     # [hidden, q_size]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor             # [hidden]
    gate_up: torch.Tensor               # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor                  # [hidden, intermediate]
    down_bias: torch.Tensor | None


@dataclass
class ModelWeights:
    embed: torch.Tensor                 # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor                  # [hidden]
    lm_head: torch.Tensor               # [vocab, hidden]; the embedding itself when tied
    flat: torch.Tensor | None = None    # [total]: the one buffer every tensor above is a view of

    @classmethod
    def empty(cls, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device) -> "ModelWeights":
        """Every tensor a view of one flat buffer, laid out in the order a publication sends them
        (embedding; per layer: input norm, q/k/v, their biases, o, post norm, gate/up, down; final
        norm; LM head), so a bucket of consecutive tensors lands with one copy."""
        h, inter = spec.hidden_size, spec.intermediate_size
        qkv_rows = spec.q_size + 2 * spec.kv_size
        shapes: list[tuple[int, ...] | None] = [(spec.vocab_size, h)]
        for _ in range(spec.num_layers):
            shapes += [(h,), (qkv_rows, h), (qkv_rows,) if spec.qkv_bias else None, (h, spec.q_size),
                       (h,) if spec.o_bias else None, (h,), (2 * inter, h), (2 * inter,) if spec.mlp_bias else None,
                       (h, inter), (h,) if spec.mlp_bias else None]
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
        embed, rest = views[0], views[1:]
        layers = []
        for i in range(spec.num_layers):
            (input_norm, qkv, qkv_bias, o, o_bias, post_norm, gate_up, gate_up_bias, down,
             down_bias) = rest[10 * i: 10 * i + 10]
            layers.append(LayerWeights(input_norm=input_norm, qkv=qkv, qkv_bias=qkv_bias, o=o, o_bias=o_bias,
                                       post_norm=post_norm, gate_up=gate_up, gate_up_bias=gate_up_bias, down=down,
                                       down_bias=down_bias))
        norm, lm_head = rest[-2], rest[-1]
        return cls(embed=embed, layers=layers, norm=norm, lm_head=embed if lm_head is None else lm_head, flat=flat)

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
            for value in vars(layer).values():
                if value is not None:
                    yield value


def hf_views(weights: ModelWeights, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF parameter name -> a view into the engine's storage with the HF shape."""
    q, kv, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    views = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm}
    if not spec.tie_word_embeddings:
        views["lm_head.weight"] = weights.lm_head
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        views[p + "input_layernorm.weight"] = layer.input_norm
        views[p + "post_attention_layernorm.weight"] = layer.post_norm
        for name, rows in (("q_proj", slice(0, q)), ("k_proj", slice(q, q + kv)), ("v_proj", slice(q + kv, q + 2 * kv))):
            views[p + f"self_attn.{name}.weight"] = layer.qkv[rows]
            if layer.qkv_bias is not None:
                views[p + f"self_attn.{name}.bias"] = layer.qkv_bias[rows]
        views[p + "self_attn.o_proj.weight"] = layer.o
        if layer.o_bias is not None:
            views[p + "self_attn.o_proj.bias"] = layer.o_bias
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
