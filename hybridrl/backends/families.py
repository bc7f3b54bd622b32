"""Model families by name: one declared row each (`ModelFamily`), found by the HF architecture a model
directory's config.json names.

A row says what the rest of the system needs to know of a family, as fields, never found by probing:

    config mapping     how config.json reads into `ModelSpec` where families differ (q/k norms, the
                       head size when absent, biases, tied embeddings, routed experts)
    weight naming      `adapter`: the Megatron adapter class (HF names <-> Megatron slots, their
                       tensor- and expert-parallel resharding); the native engine builds from the spec
    routing support    `experts`: sparse layers of routed experts, so each token has a routing record
                       (rollout routing replay, `algo.router_replay`)
    tiny-model maker   `tiny_config`: the transformers config of `hybridrl assets tiny-model --arch NAME`

A family whose layer kinds exist is one row in one file: `model.family=module:ATTR` names it (imported
and registered on every rank as the config is read). Import-light: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from hybridrl.registry import Lazy, Registry

_ADAPTERS = "hybridrl.backends.megatron.adapters"
_TINY = "hybridrl.assets.tiny_model"


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family (see the module doc)."""

    name: str                          # ModelSpec.arch
    architectures: tuple[str, ...]     # config.json's `architectures` it reads (its model_type is `name`)
    adapter: Lazy                      # the Megatron adapter class: DecoderAdapter or a subclass
    tiny_config: Lazy                  # (TinyModelSpec, common kwargs) -> a transformers PretrainedConfig
    qk_norm: bool = False              # an RMSNorm over each query and key head before RoPE
    default_head_dim: int = 0          # head_dim when config.json has none (0: hidden_size // heads)
    qkv_bias_always: bool = False      # q/k/v biased and o_proj not, whatever attention_bias says (Qwen2)
    reads_mlp_bias: bool = False       # config.json's `mlp_bias` applies (else the MLP has no bias)
    tied_by_default: bool = False      # tie_word_embeddings when config.json does not say
    experts: bool = False              # routed experts: the MoE keys are read, tokens carry routing records
    summary: str = ""


FAMILIES: Registry[ModelFamily] = Registry("model family", key="family", row=ModelFamily)


def _declare(rows: Iterable[ModelFamily]) -> None:
    for row in rows:
        FAMILIES.register(row, shipped=True)


_declare([
    ModelFamily(name="qwen2", architectures=("Qwen2ForCausalLM",), adapter=Lazy(f"{_ADAPTERS}.qwen2:Qwen2Adapter"),
                tiny_config=Lazy(f"{_TINY}:qwen2_config"), qkv_bias_always=True, tied_by_default=True,
                summary="Qwen2 / Qwen2.5: biases on q/k/v"),
    ModelFamily(name="llama", architectures=("LlamaForCausalLM",), adapter=Lazy(f"{_ADAPTERS}.llama:LlamaAdapter"),
                tiny_config=Lazy(f"{_TINY}:llama_config"), reads_mlp_bias=True, summary="Llama 2 / 3"),
    ModelFamily(name="qwen3", architectures=("Qwen3ForCausalLM",), adapter=Lazy(f"{_ADAPTERS}.qwen3:Qwen3Adapter"),
                tiny_config=Lazy(f"{_TINY}:qwen3_config"), qk_norm=True, default_head_dim=128,
                summary="Qwen3 dense: q/k norms"),
    ModelFamily(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",),
                adapter=Lazy(f"{_ADAPTERS}.qwen3:Qwen3MoeAdapter"), tiny_config=Lazy(f"{_TINY}:qwen3_moe_config"),
                qk_norm=True, default_head_dim=128, experts=True, summary="Qwen3-MoE: routed experts, no shared ones"),
])


def family_named(name: str) -> ModelFamily:
    """The row called `name` (a `ModelSpec.arch`)."""
    return FAMILIES.get(name, key="model.family")


def family_of(cfg: dict[str, Any], *, source: str = "config.json") -> ModelFamily:
    """The registered family of an HF config mapping: by its `architectures`, else its `model_type`;
    a ValueError naming both, the known architectures and how to add a family, when none is."""
    rows = FAMILIES.rows()
    archs = cfg.get("architectures") or []
    for arch in archs:
        for row in rows:
            if arch in row.architectures:
                return row
    for row in rows:
        if cfg.get("model_type") == row.name:
            return row
    known = sorted(a for row in rows for a in row.architectures)
    raise ValueError(f"{source}: architectures={archs} model_type={cfg.get('model_type')!r}: hybridrl implements "
                     f"{known}; a family of your own whose layer kinds exist is one ModelFamily row "
                     "(hybridrl/backends/families.py), named by model.family=module:ATTR")


def register_family(target: str, *, key: str = "family") -> ModelFamily:
    """`model.family=module:ATTR`: the row imported, type-checked and registered (so `family_of` finds it)."""
    row = FAMILIES.get(target, key=key)
    if not (FAMILIES.known(row.name) and FAMILIES.get(row.name) is row):
        FAMILIES.register(row, key=key)      # a name taken by another row is refused, naming both
    return row
