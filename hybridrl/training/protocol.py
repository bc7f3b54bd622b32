"""The training-engine protocol: what the RL step and the training side use of a model that trains.

A training engine holds one model (an actor, a frozen reference, or a critic: the same architecture
with a value head instead of the vocabulary projection), this rank's shard of it, driven SPMD by
every rank of the training mesh: every rank calls the same methods in the same order, and the
collectives inside keep them in step. Data-parallel ranks receive different rows; the pipeline
stages and tensor-parallel peers of one data-parallel group receive the same.

Where results land. The loss runs on the *loss ranks* (every rank of the last pipeline stage);
`compute_logprobs` / `compute_values` return their Batch there (with `on_last_stage=True`) or on
the *output ranks* (one per data-parallel group: tensor-parallel rank 0 of the last stage);
everywhere else they return None. Reductions over the data-parallel group of the loss ranks go
through `dp_sum` / `dp_max`, which put the tensor on the device that group's backend needs.

The loss function's contract (`LossFn`): `loss_fn(values [b, T], entropy [b, T] | None, micro_batch)
-> (token_loss [b, T], {name: [b, T]})`, where `values` are the token-aligned logprobs of an actor
(or the values of a critic); `train_step` reduces the token loss with the batch's `loss_mask` over
denominators counted on the whole global batch before the first backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

import torch

from hybridrl.data.batch import Batch
from hybridrl.distributed.mesh import Mesh

# what a training engine releases while the rollout engine generates (`offload(tags)`)
OPTIMIZER = "optimizer"      # optimizer state (on a CPU device: spilled to a file when a spill dir is given)
GRADS = "grads"              # gradient buffers (they hold nothing between steps)
PARAMS = "params"            # the parameters themselves (to host memory; impossible on a CPU device)
TRAIN_MEMORY_TAGS = (OPTIMIZER, GRADS)      # what a mode switch releases

LM_HEAD, VALUE_HEAD = "lm", "value"      # the model's head: next-token logits, or one value per position

LossFn = Callable[[torch.Tensor, "torch.Tensor | None", Batch], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@runtime_checkable
class TrainEngine(Protocol):
    device: torch.device
    mesh: Mesh                       # the training mesh (pp, dp, tp)
    head: str                        # LM_HEAD | VALUE_HEAD
    training: bool                   # False: frozen (a reference), no optimizer
    passes: dict[str, int]           # schedules run, by kind: "logprobs" (forward only), "train"

    @property
    def is_loss_rank(self) -> bool:
        """This rank computes the loss (the last pipeline stage)."""

    @property
    def is_output_rank(self) -> bool:
        """This rank returns its data-parallel group's outputs (tensor-parallel rank 0 of the last stage)."""

    def compute_logprobs(self, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False,
                         on_last_stage: bool = False) -> Batch | None:
        """Batch('logprobs' [B, T] (+ 'entropy')): logprobs[b, t] = log softmax(logits[b, t-1] / T)[ids[b, t]],
        0 at position 0 and on padding."""

    def compute_values(self, batch: Batch, *, on_last_stage: bool = False) -> Batch | None:
        """Batch('values' [B, T]) of a value-head engine, token-aligned like logprobs (the head at t-1)."""

    def train_step(self, batch: Batch, loss_fn: LossFn, *, temperature: float = 1.0, with_entropy: bool = False,
                   extremes: Iterable[str] = (), capture: bool = False) -> dict[str, Any]:
        """One optimizer step on this rank's rows. Returns the same scalars on every rank: loss, grad_norm,
        lr, num_tokens, num_sequences (optionally model_tokens: the positions the model ran, padding
        included, summed over data-parallel ranks), each metric's masked token mean over the global batch, and for every
        name in `extremes` its masked max and min over the global batch (`<name>_max`, `<name>_min`).
        `capture`: also 'logprobs' [B, T], the detached values the step's forward gave the loss (on the
        loss ranks; None elsewhere)."""

    def dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the data-parallel group of the loss ranks (on this engine's device on return)."""

    def dp_max(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def offload(self, tags: Iterable[str] = TRAIN_MEMORY_TAGS, *, spill_dir: str | Path | None = None) -> int:
        """Release the tagged memory for the rollout phase; returns the bytes moved or freed."""

    def reload(self) -> int:
        """Take back what `offload` released (nothing when nothing was); returns the bytes."""

    def held_bytes(self) -> dict[str, int]:
        """Optimizer state and gradient bytes this rank holds now, by accounting."""

    def save_checkpoint(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> None: ...

    def load_checkpoint(self, path: str | Path) -> dict: ...

    def scale_lr(self, factor: float) -> dict[str, float]:
        """Multiply the learning-rate schedule by `factor` (a rollback's lower learning rate); the current
        rate before and after."""

    def export_hf(self, out_dir: str | Path) -> None:
        """An HF directory of the policy (an LM-head engine only)."""

    # as the source of a publication (an LM-head engine): `publication.publish.WeightSource`
    def hf_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def hf_group_specs(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]: ...

    def write_hf_group(self, index: int, out: Mapping[str, torch.Tensor]) -> None: ...
