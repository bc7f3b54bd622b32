"""The value head of a Megatron value model (`MegatronEngine.from_hf(..., head="value")`, the critic).

The decoder (embedding, layers, final norm) is built and loaded exactly as the actor's, from an HF
directory; the vocabulary projection is replaced by a value head `v = w . h + b` (one output), and
the embedding is never tied to it. The head starts at 0, unless the directory carries one: a
1-label sequence classifier's `score.weight` (transformers' *ForSequenceClassification) or a
`value_head.safetensors` file ({"weight": [1, hidden], "bias": [1]}, written by `save_value_head`).

Values are token-aligned as logprobs are: values[b, t] is the head at position t-1, i.e. the value
of the state in which token t is chosen; position 0 and padding are 0. Everything else (schedule,
micro-batches, optimizer with its own LR schedule, offload, distributed checkpoints) is the
engine's: `train_step(batch, value_loss_fn)` hands the loss function values in place of logprobs.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueHead(torch.nn.Module):
    """Stands in for GPTModel's output layer: [s, b, h] -> ([s, b, 1], None). Replicated over TP (the
    hidden states are whole on every TP rank), so its gradients agree across TP ranks."""

    def __init__(self, hidden: int, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = False          # read by GPTModel's post-processing

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight, self.bias), None


def load_value_head(head: ValueHead, model_dir: Path) -> None:
    """Initialise the head from `value_head.safetensors` or a 1-label classifier's `score.weight` (else it stays 0)."""
    from safetensors import safe_open

    from hybridrl.backends.megatron.weights import HFCheckpoint

    with torch.no_grad():
        if (model_dir / VALUE_HEAD_FILE).exists():
            with safe_open(str(model_dir / VALUE_HEAD_FILE), framework="pt") as f:
                head.weight.copy_(f.get_tensor("weight").reshape(head.weight.shape))
                head.bias.copy_(f.get_tensor("bias").reshape(head.bias.shape))
            return
        ckpt = HFCheckpoint(model_dir)
        if "score.weight" in ckpt.names():
            score = ckpt.get("score.weight")
            if score.shape[0] != 1:
                raise ValueError(f"{model_dir}: a sequence classifier with {score.shape[0]} labels cannot be a "
                                 "value head (needs num_labels=1)")
            head.weight.copy_(score.reshape(head.weight.shape))
            if "score.bias" in ckpt.names():
                head.bias.copy_(ckpt.get("score.bias").reshape(head.bias.shape))


def save_value_head(out_dir: str | Path, weight: torch.Tensor, bias: torch.Tensor) -> Path:
    """Write `value_head.safetensors` next to an HF causal LM's files (a causal LM with a value head)."""
    from safetensors.torch import save_file

    path = Path(out_dir) / VALUE_HEAD_FILE
    save_file({"weight": weight.detach().cpu().contiguous().reshape(1, -1),
               "bias": bias.detach().cpu().contiguous().reshape(1)}, str(path))
    return path
