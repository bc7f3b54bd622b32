"""The weight-transport interface: one file per mechanism implements it.

    transport_inprocess.py  the engine lives in this process: copy into its parameter storage
    transport_cuda_ipc.py   SGLang: CUDA IPC handles of each rank's tensors, gathered to the
                            rollout TP group's engine owner, one payload per SGLang TP rank
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

NamedTensors = Sequence[tuple[str, torch.Tensor]]


class WeightTransport(Protocol):
    async def send(self, bucket: NamedTensors, version: int) -> None:
        """Deliver one bucket of HF-named full tensors for policy `version`."""

    async def digests(self, bucket: NamedTensors) -> dict[str, str]:
        """The receiver's digest of every tensor of the bucket, without loading it (verification pass)."""
