from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.launch import ROOT


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_model_loads_offline_with_chat_template(tiny_models, arch, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models(arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == arch
    assert model.config.vocab_size >= len(tok) and model.config.vocab_size % 64 == 0
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 12*34?"},
            {"role": "assistant", "content": "<calc>12*34</calc>"}, {"role": "tool", "content": "408"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text                          # byte-level: exact round trip
    digits = tok("12345", add_special_tokens=False)["input_ids"]
    assert len(digits) == 5                                  # one token per digit
    assert len(tok("<calc>", add_special_tokens=False)["input_ids"]) == 1
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)
    out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(out).all()


def test_weights_are_seeded_and_every_parameter_random(tiny_models):
    from safetensors.torch import load_file

    a = load_file(str(tiny_models("qwen2") / "model.safetensors"))
    b = load_file(str(tiny_models("qwen2", seed=1) / "model.safetensors"))
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    for name, t in a.items():
        assert t.std() > 0, f"{name} is constant: layout mistakes in it would go unnoticed"
    assert any(k.endswith("q_proj.bias") for k in a)         # qwen2 carries qkv biases


def test_cli_writes_model(tmp_path):
    out = tmp_path / "m"
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "assets", "tiny-model", "--arch", "llama", "--out",
                           str(out), "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                           "--intermediate", "64"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).exists()
