"""`hybridrl assets tiny-model`: a Hugging Face model directory built from a config, offline.

Writes config.json, generation_config.json, model.safetensors (seeded random weights),
tokenizer.json and tokenizer_config.json (ChatML template with system/user/assistant/tool
roles). `transformers.AutoModelForCausalLM` and `AutoTokenizer` load it with no network.

Every parameter is random, biases and norm scales included, so that a layout mistake in an
adapter (a swapped bias, a norm left at 1) changes the logits and is caught by parity tests.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ARCHS = ("qwen2", "llama")


@dataclass(kw_only=True)
class TinyModelSpec:
    arch: str = "qwen2"
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab_size: int = 512           # tokenizer vocabulary to train
    vocab_multiple: int = 64        # model vocab = tokenizer size rounded up (like real checkpoints)
    max_position: int = 2048
    rope_theta: float | None = None  # default: 1e6 for qwen2, 1e4 for llama
    tie_embeddings: bool | None = None  # default: True for qwen2, False for llama
    rope_scaling: tuple[tuple[str, float | str], ...] = ()   # e.g. (("rope_type", "llama3"), ("factor", 8.0), ...)
    init_std: float = 0.02
    norm_std: float = 0.1           # norm scales are 1 + N(0, norm_std)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")


def hf_config(spec: TinyModelSpec, vocab_size: int, special_ids: dict[str, int]):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate,
        max_position_embeddings=spec.max_position,
        initializer_range=spec.init_std,
        bos_token_id=None,
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids["pad"],
    )
    theta = spec.rope_theta if spec.rope_theta is not None else (1e6 if spec.arch == "qwen2" else 1e4)
    if spec.rope_scaling:
        common["rope_parameters"] = {"rope_theta": theta, **dict(spec.rope_scaling)}
    else:
        common["rope_theta"] = theta
    if spec.arch == "qwen2":
        return Qwen2Config(
            **common,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True if spec.tie_embeddings is None else spec.tie_embeddings,
        )
    return LlamaConfig(
        **common,
        rms_norm_eps=1e-5,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False if spec.tie_embeddings is None else spec.tie_embeddings,
    )


def randomize_(model: "torch.nn.Module", spec: TinyModelSpec) -> None:
    """Seeded values for every parameter: N(0, init_std), norm scales 1 + N(0, norm_std)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    norm_params = {id(m.weight) for m in model.modules() if type(m).__name__.endswith("RMSNorm")}
    for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        with torch.no_grad():
            p.copy_(1.0 + spec.norm_std * noise if id(p) in norm_params else spec.init_std * noise)


def build_tiny_model(out: str | Path, spec: TinyModelSpec) -> Path:
    """Write the model directory; returns its path."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    from hybridrl.assets.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, train_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size=spec.vocab_size, seed=spec.seed)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position, padding_side="left", clean_up_tokenization_spaces=False,
    )
    special = {"eos": hf_tok.convert_tokens_to_ids(EOS_TOKEN), "pad": hf_tok.convert_tokens_to_ids(PAD_TOKEN)}
    vocab = -(-len(hf_tok) // spec.vocab_multiple) * spec.vocab_multiple
    config = hf_config(spec, vocab, special)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, spec)
    model.generation_config = GenerationConfig(
        eos_token_id=[special["eos"], special["pad"]], pad_token_id=special["pad"], bos_token_id=None)
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    (out / "hybridrl_asset.json").write_text(json.dumps({"kind": "tiny-model", **asdict(spec)}, indent=2))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TinyModelSpec()
    parser.add_argument("--arch", choices=ARCHS, default=d.arch)
    parser.add_argument("--out", required=True, help="output directory")
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab_size", "vocab_multiple",
                 "max_position", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    parser.add_argument("--rope-theta", type=float, default=None)
    parser.add_argument("--init-std", type=float, default=d.init_std)
    parser.add_argument("--norm-std", type=float, default=d.norm_std)
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)


def main(args: argparse.Namespace) -> int:
    spec = TinyModelSpec(**{k: v for k, v in vars(args).items() if k in TinyModelSpec.__dataclass_fields__})
    out = build_tiny_model(args.out, spec)
    n = sum(1 for _ in out.iterdir())
    print(f"wrote {spec.arch} tiny model ({spec.layers} layers, hidden {spec.hidden}) to {out} ({n} files)")
    return 0
