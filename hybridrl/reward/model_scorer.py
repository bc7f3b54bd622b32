"""A reward model as a reward component: a decoder with a scalar head scores finished trajectories.

The model is an HF directory holding either a 1-label sequence classifier (transformers'
*ForSequenceClassification: the decoder's weights plus `score.weight`) or a causal LM with a value
head beside it (`value_head.safetensors`: {"weight": [1, hidden], "bias": [1]}). The score of a
trajectory is the head applied to the decoder's final hidden state at its last token (prompt and
response, observations included, exactly as the policy saw them):

    score = w . h_last + b

When the reward model's tokenizer is the policy's (same tokenizer.json) the token ids are scored as
they are; otherwise the text is decoded with the policy's tokenizer and encoded with the reward
model's. Rows are scored in batches (`batch_size`, right-padded, the last real token picked by the
attention mask). The evaluator id is `<component>:<directory name>@<sha256 of the weights, 12 hex>`,
so a record names the exact model that scored it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import torch

VALUE_HEAD_FILE = "value_head.safetensors"


def weights_version(model_dir: str | Path) -> str:
    """sha256 (12 hex) over the directory's weight files (safetensors, value head included), in name order."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(path.name.encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def load_head(model_dir: str | Path, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [hidden], bias []) of the scalar head; raises when the directory has none."""
    from safetensors import safe_open

    d = Path(model_dir)
    if (d / VALUE_HEAD_FILE).exists():
        with safe_open(str(d / VALUE_HEAD_FILE), framework="pt") as f:
            return f.get_tensor("weight").reshape(hidden).float(), f.get_tensor("bias").reshape(()).float()
    for path in sorted(d.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if "score.weight" in f.keys():
                w = f.get_tensor("score.weight")
                if w.shape[0] != 1:
                    raise ValueError(f"{d}: a sequence classifier with {w.shape[0]} labels is not a reward model "
                                     "(needs num_labels=1)")
                b = f.get_tensor("score.bias").reshape(()) if "score.bias" in f.keys() else torch.zeros(())
                return w.reshape(hidden).float(), b.float()
    raise ValueError(f"{d}: no scalar head: expected a 1-label sequence classifier (score.weight) or "
                     f"{VALUE_HEAD_FILE} beside a causal LM")


class RewardModelScorer:
    """Loads once (on the host), moves to the device only while scoring (`offload=True`)."""

    def __init__(self, model_dir: str | Path, *, component: str, device: torch.device, batch_size: int = 16,
                 offload: bool = True, policy_tokenizer_dir: str | Path | None = None):
        from transformers import AutoConfig, AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self.dir = Path(model_dir)
        if not (self.dir / "config.json").exists():
            raise FileNotFoundError(f"reward_model.path={self.dir}: not an HF model directory (no config.json)")
        config = AutoConfig.from_pretrained(self.dir)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()     # the decoder alone: the head's tensors are "unexpected" to it
        try:
            self.decoder = AutoModel.from_pretrained(self.dir, dtype=torch.float32).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
        self.decoder.requires_grad_(False)
        self.weight, self.bias = load_head(self.dir, config.hidden_size)
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir)
        mine = _file_bytes(self.dir / "tokenizer.json")
        self.same_tokenizer = (policy_tokenizer_dir is not None and mine is not None
                               and _file_bytes(Path(policy_tokenizer_dir) / "tokenizer.json") == mine)
        self.component = component
        self.evaluator = f"{component}:{self.dir.name}@{weights_version(self.dir)}"
        self.device, self.batch_size, self.offload = device, batch_size, offload
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.max_len = getattr(config, "max_position_embeddings", None)
        self._on_device = device.type == "cpu"       # on a CPU device the host is the device

    def resident_bytes(self) -> int:
        """Bytes of the reward model's weights on the device now (0 when offloaded, or on a CPU device
        where weights always live in host memory: reported by the actor's accounting as parameters)."""
        if self.device.type == "cpu" or not self._on_device:
            return 0
        return sum(p.numel() * p.element_size() for p in self.decoder.parameters())

    def to_device(self) -> int:
        if self._on_device:
            return 0
        self.decoder.to(self.device)
        self._on_device = True
        return sum(p.numel() * p.element_size() for p in self.decoder.parameters())

    def release(self) -> int:
        if self.device.type == "cpu" or not self._on_device or not self.offload:
            return 0
        moved = self.resident_bytes()
        self.decoder.to("cpu")
        self._on_device = False
        torch.cuda.empty_cache()
        return moved

    def token_rows(self, rows: Sequence[Sequence[int]], policy_tokenizer) -> list[list[int]]:
        """The reward model's token ids for the policy's rows (as they are, or re-tokenized)."""
        if self.same_tokenizer:
            out = [list(r) for r in rows]
        else:
            out = [self.tokenizer(policy_tokenizer.decode(list(r), skip_special_tokens=False),
                                  add_special_tokens=False)["input_ids"] for r in rows]
        if self.max_len:
            out = [r[-self.max_len:] for r in out]     # the end of the episode decides: keep it
        return out

    @torch.no_grad()
    def score_ids(self, rows: Sequence[Sequence[int]]) -> list[float]:
        """One score per row (reward-model token ids), in batches of `batch_size`."""
        scores: list[float] = []
        weight, bias = self.weight.to(self.device), self.bias.to(self.device)
        for start in range(0, len(rows), self.batch_size):
            part = [list(r) if len(r) else [self.pad_id] for r in rows[start: start + self.batch_size]]
            length = max(len(r) for r in part)
            ids = torch.full((len(part), length), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(part), length), dtype=torch.long)
            for i, r in enumerate(part):
                ids[i, : len(r)] = torch.tensor(r)
                mask[i, : len(r)] = 1
            hidden = self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).last_hidden_state
            last = mask.sum(dim=1) - 1
            h = hidden[torch.arange(len(part)), last.to(self.device)].float()
            scores += (h @ weight + bias).tolist()
        return scores


def _file_bytes(path: Path) -> bytes | None:
    return path.read_bytes() if path.exists() else None
