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

    @classmethod
    def empty(cls, spec: ModelSpec, *, dtype: torch.dtype, device: torch.device) -> "ModelWeights":
        def new(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        h, inter = spec.hidden_size, spec.intermediate_size
        qkv_rows = spec.q_size + 2 * spec.kv_size
        layers = [
            LayerWeights(
                input_norm=new(h), qkv=new(qkv_rows, h), qkv_bias=new(qkv_rows) if spec.qkv_bias else None,
                o=new(h, spec.q_size), o_bias=new(h) if spec.o_bias else None, post_norm=new(h),
                gate_up=new(2 * inter, h), gate_up_bias=new(2 * inter) if spec.mlp_bias else None,
                down=new(h, inter), down_bias=new(h) if spec.mlp_bias else None)
            for _ in range(spec.num_layers)
        ]
        embed = new(spec.vocab_size, h)
        lm_head = embed if spec.tie_word_embeddings else new(spec.vocab_size, h)
        return cls(embed=embed, layers=layers, norm=new(h), lm_head=lm_head)

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
