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

from hybridrl.backends.families import FAMILIES, family_named

if TYPE_CHECKING:
    import torch



@dataclass(kw_only=True)
class TinyModelSpec:
    arch: str = "qwen2"             # a model family's row (hybridrl/backends/families.py)
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab_size: int = 512           # tokenizer vocabulary to train
    vocab_multiple: int = 64        # model vocab = tokenizer size rounded up (like real checkpoints)
    max_position: int = 2048
    rope_theta: float | None = None  # default: the family's (1e6 for qwen2 and qwen3, 1e4 for llama)
    tie_embeddings: bool | None = None  # default: True for qwen2 and qwen3 (as their small models), False for llama, qwen3_moe
    rope_scaling: tuple[tuple[str, float | str], ...] = ()   # e.g. (("rope_type", "llama3"), ("factor", 8.0), ...)
    head_dim: int | None = None     # default: hidden // heads
    # qwen3_moe only
    experts: int = 8
    experts_per_tok: int = 2
    moe_intermediate: int = 64
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    init_std: float = 0.02
    norm_std: float = 0.1           # norm scales are 1 + N(0, norm_std)
    seed: int = 0

    def __post_init__(self) -> None:
        if not FAMILIES.known(self.arch):
            raise ValueError(f"arch must be one of {FAMILIES.names()} (the model families' rows), got {self.arch!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if family_named(self.arch).experts and not 1 <= self.experts_per_tok <= self.experts:
            raise ValueError(f"experts_per_tok ({self.experts_per_tok}) must be in [1, experts={self.experts}]")


def hf_config(spec: TinyModelSpec, vocab_size: int, special_ids: dict[str, int]):
    """The transformers config of the tiny model: the family row's `tiny_config` over the keys every
    family shares."""
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
    return family_named(spec.arch).tiny_config(spec, common)


def with_rope(common: dict, spec: TinyModelSpec, default_theta: float) -> dict:
    """`common` with the RoPE keys: `rope_parameters` when scaled, else `rope_theta`."""
    theta = spec.rope_theta if spec.rope_theta is not None else default_theta
    if spec.rope_scaling:
        return dict(common, rope_parameters={"rope_theta": theta, **dict(spec.rope_scaling)})
    return dict(common, rope_theta=theta)


def _tied(spec: TinyModelSpec, default: bool) -> bool:
    return default if spec.tie_embeddings is None else spec.tie_embeddings


def _with_head_dim(common: dict, spec: TinyModelSpec) -> dict:
    return common if spec.head_dim is None else dict(common, head_dim=spec.head_dim)


def qwen2_config(spec: TinyModelSpec, common: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**_with_head_dim(with_rope(common, spec, 1e6), spec), rms_norm_eps=1e-6,
                       tie_word_embeddings=_tied(spec, True))


def llama_config(spec: TinyModelSpec, common: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**_with_head_dim(with_rope(common, spec, 1e4), spec), rms_norm_eps=1e-5, attention_bias=False,
                       mlp_bias=False, tie_word_embeddings=_tied(spec, False))


def _qwen3_common(spec: TinyModelSpec, common: dict, tied: bool) -> dict:
    return dict(with_rope(common, spec, 1e6), head_dim=spec.head_dim or spec.hidden // spec.heads, rms_norm_eps=1e-6,
                attention_bias=False, tie_word_embeddings=_tied(spec, tied))


def qwen3_config(spec: TinyModelSpec, common: dict):
    from transformers import Qwen3Config

    return Qwen3Config(**_qwen3_common(spec, common, True))


def qwen3_moe_config(spec: TinyModelSpec, common: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_qwen3_common(spec, common, False), num_experts=spec.experts,
                          num_experts_per_tok=spec.experts_per_tok, moe_intermediate_size=spec.moe_intermediate,
                          norm_topk_prob=spec.norm_topk_prob, decoder_sparse_step=spec.decoder_sparse_step,
                          mlp_only_layers=list(spec.mlp_only_layers), router_aux_loss_coef=0.001)


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
    parser.add_argument("--arch", choices=FAMILIES.names(), default=d.arch)
    parser.add_argument("--out", required=True, help="output directory")
    for name in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab_size", "vocab_multiple",
                 "max_position", "seed", "head_dim"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    moe = parser.add_argument_group("qwen3_moe")
    moe.add_argument("--experts", type=int, default=d.experts, help="routed experts per sparse layer")
    moe.add_argument("--experts-per-tok", type=int, default=d.experts_per_tok, help="the router's top-k")
    moe.add_argument("--moe-intermediate", type=int, default=d.moe_intermediate, help="each expert's FFN width")
    moe.add_argument("--norm-topk-prob", action=argparse.BooleanOptionalAction, default=d.norm_topk_prob)
    moe.add_argument("--decoder-sparse-step", type=int, default=d.decoder_sparse_step,
                     help="layer i is sparse when (i + 1) %% step == 0 (and not in --mlp-only-layers)")
    moe.add_argument("--mlp-only-layers", type=int, nargs="*", default=list(d.mlp_only_layers),
                     help="layers that keep a dense MLP")
    parser.add_argument("--rope-theta", type=float, default=None)
    parser.add_argument("--init-std", type=float, default=d.init_std)
    parser.add_argument("--norm-std", type=float, default=d.norm_std)
    parser.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None)


def main(args: argparse.Namespace) -> int:
    values = {k: v for k, v in vars(args).items() if k in TinyModelSpec.__dataclass_fields__}
    values["mlp_only_layers"] = tuple(values.get("mlp_only_layers") or ())
    spec = TinyModelSpec(**values)
    out = build_tiny_model(args.out, spec)
    n = sum(1 for _ in out.iterdir())
    experts = f", {spec.experts} experts top-{spec.experts_per_tok}" if family_named(spec.arch).experts else ""
    print(f"wrote {spec.arch} tiny model ({spec.layers} layers, hidden {spec.hidden}{experts}) to {out} ({n} files)")
    return 0
