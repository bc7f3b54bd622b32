"""The `model` section: the policy model's directory, and a model family of one's own
(`backends/families.py`), registered as the config is read so every rank knows it."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.backends.families import register_family
from hybridrl.config.fields import knob


@dataclass(kw_only=True)
class ModelConfig:
    """The policy model: a Hugging Face model directory on local disk."""

    path: str = knob("", "HF model directory on local disk (config.json, *.safetensors, tokenizer files); "
                         "dtypes are per engine: train.dtype, rollout.native.dtype, rollout.sglang.dtype")
    family: str = knob("", "a model family of your own, 'module:ATTR' naming a hybridrl.backends.families."
                           "ModelFamily row (registered on every rank as the config is read); empty: the shipped "
                           "family whose HF architecture config.json names (qwen2, llama, qwen3, qwen3_moe)")

    def __post_init__(self) -> None:
        if self.family:
            register_family(self.family)
