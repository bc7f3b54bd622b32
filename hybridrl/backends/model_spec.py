"""`ModelSpec`: a decoder model's shape, read from an HF model directory's config.json.

The one HF-config parser of hybridrl: the native engine and the Megatron adapters both build from
it, so training and generation cannot disagree on what a checkpoint means (RoPE scaling, biases,
tied embeddings, head sizes, q/k norms, experts). Read straight from the JSON (no transformers
import), for the families registered in `backends/families.py` (each row says where its family's
configs differ: Qwen2, Llama, Qwen3, Qwen3-MoE, or one of your own). Anything neither engine implements
(sliding windows, RoPE types other than default / linear / llama3, shared experts) is refused with
an error naming the key, rather than silently computing something else.

Mixture of experts (Qwen3-MoE): layer i is sparse when it is not in `mlp_only_layers` and
`(i + 1) % decoder_sparse_step == 0`; its router is softmax over all experts then the top
`num_experts_per_tok`, those weights renormalised to sum to 1 when `norm_topk_prob`; each expert is
a SwiGLU MLP of width `moe_intermediate_size`; there are no shared experts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.backends.families import family_of

ROPE_TYPES = ("default", "linear", "llama3")
ROPE_PARAMS = {"default": (), "linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    arch: str                        # its family row's name (backends/families.py): "qwen2", "llama", ...
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_params: tuple[tuple[str, float], ...] = ()   # factor, low/high_freq_factor, original_max_...
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool = False            # RMSNorm over each head's query and key, before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # mixture of experts (0 / () for dense models)
    num_experts: int = 0
    num_experts_per_tok: int = 0     # the router's top-k
    moe_intermediate_size: int = 0   # each expert's FFN width
    norm_topk_prob: bool = False     # renormalise the top-k weights to sum to 1
    moe_layers: tuple[int, ...] = () # the sparse layers' indices, ascending
    router_aux_loss_coef: float = 0.0   # the family's load-balancing coefficient (informative)

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def moe_index(self, layer: int) -> int | None:
        """The position of `layer` among the sparse layers (the routing record's layer axis), or None."""
        try:
            return self.moe_layers.index(layer)
        except ValueError:
            return None

    @property
    def routing_dtype(self):
        """The smallest integer dtype that holds an expert id (what a routing record is stored in)."""
        import torch

        return torch.int8 if self.num_experts <= 127 else torch.int16

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def qkv_by_group(self, fused: Any) -> tuple[Any, Any, Any]:
        """q, k, v of a fused q/k/v weight [rows, hidden] or bias [rows] whose rows run per KV group (each
        group's query heads, then its key head, then its value head: Megatron's layout) as views [groups, rows
        of each per group, *rest]: each the HF tensor's elements in their order, in a shape a view can have."""
        q_rows, hd = self.heads_per_group * self.head_dim, self.head_dim
        grouped = fused.view(self.num_kv_heads, q_rows + 2 * hd, *fused.shape[1:])
        return grouped[:, :q_rows], grouped[:, q_rows: q_rows + hd], grouped[:, q_rows + hd:]

    def padded_vocab_size(self, tp: int, divisible_by: int) -> int:
        """The vocabulary padded to a multiple of `divisible_by * tp` (Megatron's embedding layout)."""
        multiple = divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelSpec":
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{model_dir} is not an HF model directory: no config.json")
        cfg = json.loads(path.read_text())
        return cls.from_hf_config(cfg, eos_token_ids=tuple(eos_token_ids(model_dir)), source=str(path))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any, *, eos_token_ids: tuple[int, ...] = (),
                       source: str = "config.json") -> "ModelSpec":
        """From a config.json mapping (or a transformers config object, through its `to_dict()`)."""
        if not isinstance(cfg, dict):
            cfg = cfg.to_dict()
        family = family_of(cfg, source=source)
        arch = family.name
        if cfg.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not implemented (full attention only)")
        kinds = set(cfg.get("layer_types") or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ValueError(f"{source}: layer_types {sorted(kinds)} are not implemented (full attention only)")
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"{source}: hidden_act={hidden_act!r} is not implemented (silu only)")
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        rope_theta, rope_type, rope_params = _rope(cfg, source)
        attention_bias = bool(cfg.get("attention_bias", False))
        # transformers' defaults where a key is absent (Qwen3 configs default head_dim to 128)
        head_dim = cfg.get("head_dim") or family.default_head_dim or cfg["hidden_size"] // num_heads
        moe = _moe(cfg, source, cfg["num_hidden_layers"], arch) if family.experts else {}
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=rope_params,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tied_by_default)),
            qkv_bias=True if family.qkv_bias_always else attention_bias,
            o_bias=False if family.qkv_bias_always else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if family.reads_mlp_bias else False,
            qk_norm=family.qk_norm,
            eos_token_ids=tuple(eos_token_ids),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            **moe,
        )

    def inv_freq(self):
        """RoPE inverse frequencies [head_dim // 2], float32, as transformers computes them."""
        import torch

        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        params = dict(self.rope_params)
        if self.rope_type == "linear":
            inv = inv / params["factor"]
        elif self.rope_type == "llama3":
            factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
            old_len = params["original_max_position_embeddings"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
            smooth = (old_len / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
            inv = torch.where(medium, smoothed, scaled)
        return inv


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    """(theta, type, parameters) from `rope_parameters` (transformers 5) or `rope_scaling` (older
    configs); a type the engines do not implement, or one missing a parameter, is refused."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    rope = dict(cfg.get(key) or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: {key}.rope_type={rope_type!r} is not implemented (one of {ROPE_TYPES}); "
                         "hybridrl would rotate differently from the checkpoint's training")
    missing = [k for k in ROPE_PARAMS[rope_type] if k not in rope]
    if missing:
        raise ValueError(f"{source}: {key} with rope_type={rope_type!r} lacks {missing}")
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor != 1 is not implemented")
    if rope_type != "default" and rope.get("attention_factor") not in (None, 1, 1.0):
        raise ValueError(f"{source}: {key}.attention_factor={rope['attention_factor']} is not implemented")
    params = tuple(sorted((k, float(rope[k])) for k in ROPE_PARAMS[rope_type]))
    return theta, rope_type, params


def _moe(cfg: dict[str, Any], source: str, num_layers: int, arch: str) -> dict[str, Any]:
    """The ModelSpec fields of a routed-experts config such as Qwen3-MoE's (transformers 5 writes
    num_local_experts)."""
    num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)
    top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"{source}: num_experts={num_experts} / num_experts_per_tok={top_k}: need "
                         "1 <= num_experts_per_tok <= num_experts")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key):
            raise ValueError(f"{source}: {key}={cfg[key]}: shared experts are not implemented for {arch}")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)), "moe_layers": layers,
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", 0.0) or 0.0)}


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """The checkpoint's HF tensor names and shapes, from the safetensors headers (no data read)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return shapes


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """The checkpoint's end-of-sequence ids: config.json's, then generation_config.json's others (either file
    may be missing)."""
    eos: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos += [i for i in _as_ids(json.loads(path.read_text()).get("eos_token_id")) if i not in eos]
    return eos


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
