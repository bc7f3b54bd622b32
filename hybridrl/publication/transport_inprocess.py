"""In-process transport: the rollout engine shares this process (the native engine).

Each bucket is handed to `engine.update_weights`, which validates the whole bucket, then copies
every tensor into the engine's existing parameter storage (no second copy of the model).
`fault` is a fault-injection hook (name, tensor) -> tensor applied to what is delivered, for
testing that a corrupted publication is refused.
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.publication.manifest import tensor_digest
from hybridrl.publication.transport import NamedTensors
from hybridrl.rollout.protocol import RolloutEngine


class InProcessTransport:
    def __init__(self, engine: RolloutEngine, fault: Callable[[str, torch.Tensor], torch.Tensor] | None = None):
        self.engine = engine
        self.fault = fault

    def _deliver(self, bucket: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        return [(n, self.fault(n, t) if self.fault else t) for n, t in bucket]

    async def digests(self, bucket: NamedTensors) -> dict[str, str]:
        """What the engine would receive, hashed on the receiving side (nothing is copied)."""
        return {name: tensor_digest(name, t) for name, t in self._deliver(bucket)}

    async def send(self, bucket: NamedTensors, version: int) -> None:
        await self.engine.update_weights(self._deliver(bucket), version)
