"""The one HF-config parser: Qwen3 / Qwen3-MoE fields, RoPE scaling as transformers computes it,
and configs the engines cannot honour refused with the key named."""

from __future__ import annotations

import pytest
import torch

from hybridrl.backends.model_spec import ModelSpec
from tests.backends.families import hf_config


def test_qwen3_and_qwen3_moe_fields():
    q = ModelSpec.from_hf_config(hf_config("qwen3"))
    assert (q.arch, q.qk_norm, q.qkv_bias, q.head_dim, q.q_size, q.tie_word_embeddings, q.is_moe) == \
        ("qwen3", True, False, 24, 96, True, False)
    m = ModelSpec.from_hf_config(hf_config("qwen3_moe"))
    assert (m.arch, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.norm_topk_prob) == \
        ("qwen3_moe", 8, 2, 32, True)
    assert m.moe_layers == (0, 2) and m.moe_index(2) == 1 and m.moe_index(1) is None
    assert m.routing_dtype == torch.int8
    # decoder_sparse_step: every second layer sparse, minus mlp_only_layers; hub configs say num_experts
    cfg = hf_config("qwen3_moe").to_dict()
    cfg.update(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=200)
    cfg.pop("num_local_experts", None)
    m = ModelSpec.from_hf_config(cfg)
    assert m.moe_layers == (1, 5) and m.num_experts == 200 and m.routing_dtype == torch.int16


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "default", "rope_theta": 1e6},
])
def test_rope_frequencies_are_transformers_own(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=rope)
    spec = ModelSpec.from_hf_config(config)
    theirs = LlamaRotaryEmbedding(config)
    assert theirs.attention_scaling == 1.0
    torch.testing.assert_close(spec.inv_freq(), theirs.inv_freq.float(), rtol=0, atol=0)


@pytest.mark.parametrize("family, change, message", [
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     r"rope_parameters.rope_type='yarn' is not implemented"),
    ("llama3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     r"rope_parameters.rope_type='dynamic'"),
    ("llama3", {"rope_parameters": None, "rope_scaling": {"type": "longrope", "factor": 2.0}},
     r"rope_scaling.rope_type='longrope'"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     r"lacks \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]"),
    ("llama3", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 0.5}},
     r"attention_factor=0.5"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
    ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
])
def test_configs_the_engines_cannot_honour_are_refused_naming_the_key(family, change, message):
    cfg = hf_config(family).to_dict()
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_a_refused_config_stops_preflight(family_models, tmp_path):
    """The training entry points refuse such a model before any process starts."""
    import json
    import shutil

    from hybridrl.preflight import PreflightError, check_layout

    bad = tmp_path / "yarn"
    shutil.copytree(family_models("llama3"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PreflightError, match="rope_type='yarn'"):
        check_layout(str(bad), 1, 1, 1)
    with pytest.raises(PreflightError, match="train.ep=2: expert parallelism needs a mixture-of-experts model"):
        check_layout(str(family_models("qwen3")), 1, 1, 2, ep=2)
    with pytest.raises(PreflightError, match="train.tp=2 with a mixture-of-experts model"):
        check_layout(str(family_models("qwen3_moe")), 2, 1, 2)
    with pytest.raises(PreflightError, match="train.ep=3: does not divide the model's 8 experts"):
        check_layout(str(family_models("qwen3_moe")), 1, 1, 3, ep=3)
    check_layout(str(family_models("qwen3_moe")), 1, 1, 2, ep=2)
    check_layout(str(family_models("qwen3_moe")), 2, 1, 2, training=False)      # scoring: TP is fine
