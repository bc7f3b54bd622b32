"""In-process transport: the rollout engine shares this process (the native engine).

Each bucket is handed to `engine.update_weights`, which validates the whole bucket, then copies
every tensor into the engine's existing parameter storage (no second copy of the model).
"""

from __future__ import annotations

from hybridrl.resharding.transport import NamedTensors
from hybridrl.rollout.protocol import RolloutEngine


class InProcessTransport:
    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    async def send(self, bucket: NamedTensors, version: int) -> None:
        await self.engine.update_weights(list(bucket), version)
