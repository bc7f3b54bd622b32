"""`hybridrl assets tiny-classifier`: a tiny reward model whose scores follow a known rule.

    hybridrl assets tiny-classifier --policy POLICY_DIR --out DIR [--positive 0123456789]

A 1-label Qwen2 sequence classifier sharing the policy's tokenizer, with weights set (not trained)
so that its score of a sequence is exactly known:

    score = 1 if the sequence's last token is one of the `--positive` characters' tokens, else 0

How: the single layer's attention output and MLP output projections are 0 (the residual stream
passes the embedding through), the embedding of a positive token is s * e_0 and of any other
token s * e_1, the norms are 1, and score.weight = e_0 / sqrt(hidden): RMSNorm maps s * e_i to
sqrt(hidden) * e_i, so the head reads 1 or 0 (to ~1e-6). A stand-in for a learned reward model
with a checkable answer: tests compare its recorded scores to the rule.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SCALE = 10.0


def positive_token_ids(tokenizer, characters: str) -> list[int]:
    """The ids of the single-token encodings of `characters` (each must be one token)."""
    ids = []
    for ch in characters:
        enc = tokenizer(ch, add_special_tokens=False)["input_ids"]
        if len(enc) != 1:
            raise ValueError(f"{ch!r} is {len(enc)} tokens in this tokenizer: choose characters that are one token")
        ids.append(enc[0])
    return sorted(set(ids))


def build_tiny_classifier(out: str | Path, policy_dir: str | Path, positive: str = "0123456789",
                          hidden: int = 16) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    out, policy_dir = Path(out), Path(policy_dir)
    tok = AutoTokenizer.from_pretrained(policy_dir)
    vocab = json.loads((policy_dir / "config.json").read_text())["vocab_size"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=2 * hidden, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, num_labels=1, pad_token_id=pad,
                         eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config).float()
    ids = positive_token_ids(tok, positive)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()                            # the layer adds nothing to the residual stream
            elif name.endswith("bias"):
                p.zero_()
        emb = model.model.embed_tokens.weight
        emb.zero_()
        emb[:, 1] = SCALE
        emb[ids, 1] = 0.0
        emb[ids, 0] = SCALE
        model.score.weight.zero_()
        model.score.weight[0, 0] = 1.0 / math.sqrt(hidden)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in SIDE_FILES:
        if (policy_dir / name).exists():
            shutil.copyfile(policy_dir / name, out / name)
    (out / "hybridrl_asset.json").write_text(json.dumps(
        {"kind": "tiny-classifier", "rule": "1 if the last token is a positive token, else 0",
         "positive": positive, "positive_token_ids": ids, "policy": str(policy_dir)}, indent=2))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", required=True, help="the policy's HF directory (its tokenizer is shared)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--positive", default="0123456789",
                        help="characters whose token, as the last token, scores 1 (each must be one token)")
    parser.add_argument("--hidden", type=int, default=16)


def main(args: argparse.Namespace) -> int:
    out = build_tiny_classifier(args.out, args.policy, positive=args.positive, hidden=args.hidden)
    print(f"wrote a tiny reward classifier to {out}: score 1 when the last token is one of {args.positive!r}")
    return 0
