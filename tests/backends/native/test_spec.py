"""ModelSpec from config.json, and checkpoint loading errors that name the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.backends.model_spec import ModelSpec

pytestmark = pytest.mark.timeout(120)


def test_spec_reads_the_tiny_models(tiny_models):
    q = ModelSpec.from_dir(tiny_models("qwen2"))
    assert (q.arch, q.qkv_bias, q.o_bias, q.tie_word_embeddings, q.rope_theta) == ("qwen2", True, False, True, 1e6)
    assert q.eos_token_ids == (2, 0) and q.head_dim == 16 and q.vocab_size == 576
    ll = ModelSpec.from_dir(tiny_models("llama"))
    assert (ll.arch, ll.qkv_bias, ll.tie_word_embeddings, ll.rope_theta) == ("llama", False, False, 1e4)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}, "implements"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_configs_are_refused(tiny_models, change, message):
    cfg = json.loads((tiny_models("qwen2") / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_hf_config(cfg)


def test_checkpoint_problems_name_the_tensor(tiny_models, tmp_path, make_engine):
    src = tiny_models("llama")
    for bad, message in [("missing", "lacks 1 tensor"), ("extra", "'model.layers.7.foo.weight' is not a parameter"),
                         ("shape", "has shape")]:
        d = tmp_path / bad
        shutil.copytree(src, d)
        tensors = load_file(d / "model.safetensors")
        if bad == "missing":
            tensors.pop("model.norm.weight")
        elif bad == "extra":
            tensors["model.layers.7.foo.weight"] = torch.zeros(2)
        else:
            tensors["model.norm.weight"] = torch.zeros(3)
        save_file(tensors, d / "model.safetensors")
        with pytest.raises(ValueError, match=message):
            make_engine(d)
