"""Models built with transformers alone (none of hybridrl's code), for the family parity tests:
Qwen3 dense (per-head q/k norm, tied head, explicit head_dim), Qwen3-MoE (8 experts, top-2,
renormalised top-k, a dense layer among sparse ones), and Llama with llama3 RoPE scaling whose
original context is short enough that the scaling changes the logits of these sequences.

Weights are random with a larger spread than the 0.02 default (norm scales around 1) so that a
layout mistake moves the logits visibly and routing is far from uniform.
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen3", "qwen3_moe", "llama3")
VOCAB = 320
EOS = 2


def hf_config(family: str):
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=96, max_position_embeddings=512, eos_token_id=EOS,
                  pad_token_id=None, bos_token_id=None)     # (no padding_idx: its gradient would be zeroed)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=24, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=16, tie_word_embeddings=False, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[1], router_aux_loss_coef=0.001)
    if family == "llama3":
        return LlamaConfig(**common, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 16})
    raise ValueError(family)


def build(family: str, out: Path, *, seed: int = 0, std: float = 0.15) -> Path:
    """Write a random `family` model to `out` with save_pretrained (config, weights, generation config)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else std * noise)
    model.generation_config = GenerationConfig(eos_token_id=EOS, pad_token_id=0, bos_token_id=None)
    model.save_pretrained(out)
    return Path(out)


def load(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_routing(model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own expert choice for every token of `ids` [T]: [T, moe_layers, top_k], each
    row sorted (for comparisons as sets)."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out, j=j: chosen.__setitem__(j, out[2]))
             for j, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(ids.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([chosen[j] for j in sorted(chosen)], dim=1).sort(dim=-1).values


def forced_routing_logits(model, ids: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """transformers' logits [T, V] for `ids` [T] with every sparse layer's experts forced to
    `routed` [T, moe_layers, top_k] (rows with -1 keep the router's own choice); the weights are the
    router's own probabilities at those experts, renormalised when the model renormalises: what
    routing replay computes."""
    import torch.nn.functional as F

    layers = [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    saved = []
    for j, layer in enumerate(layers):
        gate = layer.mlp.gate
        saved.append(gate.forward)

        def forward(hidden, gate=gate, j=j):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            own = torch.topk(probs, gate.top_k, dim=-1).indices
            target = routed[:, j].long()
            index = torch.where((target >= 0).all(-1, keepdim=True), target, own)
            weights = probs.gather(1, index)
            if gate.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), index

        gate.forward = forward
    try:
        with torch.no_grad():
            return model(ids.unsqueeze(0)).logits[0].float()
    finally:
        for layer, fwd in zip(layers, saved):
            layer.mlp.gate.forward = fwd
