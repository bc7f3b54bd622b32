"""Flat buckets into this rank's vLLM engine, one collective RPC per bucket.

The bucket's buffer travels whole with its layout (names, shapes, dtypes, byte offsets) to vLLM's
worker process (on CPU as one out-of-band frame of vLLM's RPC encoder, on CUDA as an IPC handle of
the buffer), where `worker.WeightSync` makes the views, copies them into the parameters in place
and, with the sender's digests, hashes its own storage of each: the engine raises `WeightMismatch`
for those that differ (publish.verify=post_copy) and counts only the others as arrived.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hybridrl.publication.buckets import FlatBucket


class BucketRpcTransport:
    def __init__(self, engine: Any):
        self.engine = engine

    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        if digests is not None and names is not None:
            digests = {n: digests[n] for n in names}
        await self.engine.load_bucket(bucket, version, names=names, digests=digests)
