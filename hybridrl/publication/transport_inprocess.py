"""In-process transport: the rollout engine shares this process (the native engine).

Each bucket's views go to `engine.update_weights`, which validates the call whole, copies it into
the engine's existing storage (one copy per run of tensors that lie back to back on both sides)
and, given the sender's digests, hashes its own storage after the copy.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from hybridrl.publication.buckets import FlatBucket


class InProcessTransport:
    verifies = True

    def __init__(self, engine):
        self.engine = engine

    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        await self.engine.update_weights(bucket.named(names), version, digests=digests)
