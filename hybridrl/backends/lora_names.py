"""What LoRA adapters are called and how large they are, on every side of a run: the trainer that
trains them (`backends/megatron/lora.py`), the engine that applies them (`backends/native/lora.py`)
and the PEFT directory a run exports. A publication of adapters matches tensors by these names, so
both ends must take them from here.

    module  model.layers.{i}.self_attn.q_proj            (HF's module of the projection)
    factor  model.layers.{i}.self_attn.q_proj.lora_A.weight [rank, in]; lora_B.weight [out, rank]
            (PEFT's names without their `base_model.model.` prefix)
"""

from __future__ import annotations

# the HF projections an adapter can target, in the order a run lists them
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_name(layer: int, projection: str) -> str:
    """The HF module an adapter belongs to: `model.layers.{i}.self_attn.q_proj`."""
    return f"model.layers.{layer}.{_MODULE[projection]}.{projection}"


def factor_name(layer: int, projection: str, factor: str) -> str:
    """One factor's published name (`factor` "A" or "B"): `model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return f"{module_name(layer, projection)}.lora_{factor}.weight"


def projection_shapes(spec) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF projection's weight (`spec`: a `ModelSpec`)."""
    h, q, kv, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
