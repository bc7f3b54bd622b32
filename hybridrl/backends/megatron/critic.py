"""`CriticEngine`: a value model on Megatron-core: the actor's architecture with a scalar value head.

The decoder (embedding, layers, final norm) is built and loaded exactly as the actor's, from an HF
directory; the vocabulary projection is replaced by a value head `v = w . h + b` (one output), and
the embedding is never tied to it. The head starts at 0, unless the directory carries one: a
1-label sequence classifier's `score.weight` (transformers' *ForSequenceClassification) or a
`value_head.safetensors` file ({"weight": [1, hidden], "bias": [1]}, written by `save_value_head`).

Values are token-aligned as logprobs are: values[b, t] is the head at position t-1, i.e. the value
of the state in which token t is chosen; position 0 and padding are 0. Everything else (schedule,
micro-batches, optimizer with its own LR schedule, offload, distributed checkpoints) is the
actor's engine: `train_step(batch, value_loss_fn)` hands the loss function values in place of
logprobs.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridrl.backends.megatron import cpu_compat
from hybridrl.backends.megatron.config import MegatronConfig
from hybridrl.backends.megatron.engine import MegatronEngine, _training_state, default_device
from hybridrl.data.batch import Batch

log = logging.getLogger(__name__)

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


class CriticEngine(MegatronEngine):
    """A trainable value model; `compute_values(batch)` and `train_step(batch, loss_fn)`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from hybridrl.backends.megatron.adapters.base import Role

        # the value head is no slot of the HF model: nothing of it is published or exported
        self.params = {slot: p for slot, p in self.params.items() if slot.role is not Role.OUTPUT}

    @classmethod
    def from_hf(cls, model_path: str | Path, cfg: MegatronConfig, *, training: bool = True,
                device: torch.device | None = None) -> "CriticEngine":
        from hybridrl.backends.megatron import parallel
        from hybridrl.backends.megatron.adapters import adapter_for
        from hybridrl.backends.megatron.adapters.base import Role
        from hybridrl.backends.megatron.model import (
            DTYPES,
            build_gpt_model,
            local_layers,
            mark_tensor_parallel,
            transformer_config,
        )
        from hybridrl.backends.megatron.weights import load_hf_weights, owned_params
        from hybridrl.backends.model_spec import ModelSpec

        model_dir = Path(model_path)
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"{model_dir}: not an HF model directory (no config.json)")
        device = device or default_device()
        if device.type == "cpu":
            cpu_compat.activate()
        spec = ModelSpec.from_dir(model_dir)
        adapter = adapter_for(spec, tp=cfg.tp, vocab_divisible_by=cfg.make_vocab_size_divisible_by)
        with cpu_compat.device_scope(device):
            mesh = parallel.ensure_model_parallel(cfg.tp, cfg.pp, cfg.seed)
            tconfig = transformer_config(spec, cfg, device=device)
            model = build_gpt_model(dataclasses.replace(spec, tie_word_embeddings=False), cfg, tconfig,
                                    padded_vocab_size=adapter.padded_vocab_size, device=device)
            if model.post_process:
                model.output_layer = ValueHead(spec.hidden_size, dtype=DTYPES[cfg.dtype], device=device)
                _load_value_head(model.output_layer, model_dir)
            params = {s: p for s, p in owned_params(adapter, model, local_layers(model)).items()
                      if s.role is not Role.OUTPUT}
            mark_tensor_parallel(params)
            load_hf_weights(adapter, params, model_dir)
            ddp = optimizer = scheduler = None
            if training:
                ddp, optimizer, scheduler = _training_state(model, tconfig, cfg)
            else:
                model.requires_grad_(False)
                model.eval()
        engine = cls(cfg=cfg, model_dir=model_dir, adapter=adapter, model=model, ddp=ddp, optimizer=optimizer,
                     scheduler=scheduler, device=device, mesh=mesh, training=training)
        log.info("megatron critic: %s + value head, tp=%d pp=%d dp=%d, from %s", adapter.family, cfg.tp, cfg.pp,
                 mesh.dp_size, model_dir)
        return engine

    # ------------------------------------------------------------------ values

    def _token_logprobs(self, mb, logits, temperature, with_entropy):
        """The schedule's output here is the head's [b, T, 1]: token-aligned values (see the module doc)."""
        from hybridrl.backends.megatron.logprobs import token_aligned

        return token_aligned(logits[..., 0].float(), mb.attention_mask), None

    def compute_values(self, batch: Batch, *, on_last_stage: bool = False) -> Batch | None:
        """values [B, T] float32, token-aligned, on the output ranks (`on_last_stage`: every rank of the
        last pipeline stage), None elsewhere."""
        out = self.compute_logprobs(batch, on_last_stage=on_last_stage)
        return None if out is None else Batch({"values": out["logprobs"]}, num_padding=batch.num_padding)

    def value_head(self) -> dict[str, torch.Tensor] | None:
        """The head's tensors on the last pipeline stage (None elsewhere)."""
        head = self.model.output_layer if self.model.post_process else None
        return None if head is None else {"weight": head.weight.detach().cpu().clone(),
                                          "bias": head.bias.detach().cpu().clone()}

    # ------------------------------------------------------------------ not a policy

    def iter_hf_tensors(self):
        raise TypeError("a critic has no language-model head: it is never published or exported as a policy")

    iter_hf_groups = iter_hf_tensors

    def export_hf(self, out_dir):
        raise TypeError("a critic is saved in the run's distributed checkpoints, not exported as an HF policy")


def _load_value_head(head: ValueHead, model_dir: Path) -> None:
    """Initialise the head from `value_head.safetensors` or a 1-label classifier's `score.weight`."""
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
