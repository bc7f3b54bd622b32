"""`ModelSpec`: a decoder model's shape, read from an HF model directory's config.json.

The one HF-config parser of hybridrl: the native engine and the Megatron adapters both build from
it, so training and generation cannot disagree on what a checkpoint means (RoPE scaling, biases,
tied embeddings, head sizes). Read straight from the JSON (no transformers import), for the Qwen2
and Llama families. Anything neither engine implements (sliding windows, unknown RoPE types) is
refused with an error naming the key, rather than silently computing something else.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    arch: str                        # "qwen2" | "llama"
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
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        eos = _as_ids(cfg.get("eos_token_id"))
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            eos += [i for i in _as_ids(json.loads(gen_path.read_text()).get("eos_token_id")) if i not in eos]
        return cls.from_hf_config(cfg, eos_token_ids=tuple(eos), source=str(path))

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any] | Any, *, eos_token_ids: tuple[int, ...] = (),
                       source: str = "config.json") -> "ModelSpec":
        """From a config.json mapping (or a transformers config object, through its `to_dict()`)."""
        if not isinstance(cfg, dict):
            cfg = cfg.to_dict()
        archs = cfg.get("architectures") or []
        arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            arch = {"qwen2": "qwen2", "llama": "llama"}.get(cfg.get("model_type", ""))
        if arch is None:
            raise ValueError(f"{source}: architectures={archs} model_type={cfg.get('model_type')!r}: hybridrl "
                             f"implements {sorted(ARCHITECTURES)}")
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
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: rope_type={rope_type!r} is not implemented (one of {ROPE_TYPES})")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor != 1 is not implemented")
        rope_params = tuple(sorted((k, float(v)) for k, v in rope.items()
                                   if k in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings")))
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_type=rope_type,
            rope_params=rope_params,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "qwen2")),
            qkv_bias=True if arch == "qwen2" else attention_bias,
            o_bias=False if arch == "qwen2" else attention_bias,
            mlp_bias=False if arch == "qwen2" else bool(cfg.get("mlp_bias", False)),
            eos_token_ids=tuple(eos_token_ids),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
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


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
