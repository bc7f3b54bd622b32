"""The weight-transport interface: one file per mechanism implements it.

    transport_inprocess.py          the engine lives in this process (the native engine): its
                                    `update_weights` copies each bucket into its own storage
    backends/sglang/transport.py    SGLang: CUDA IPC handles of each rank's flat bucket, gathered
                                    to the rollout TP group's engine owner, one payload per TP rank

A transport delivers one `FlatBucket` (a flat buffer with a view per tensor) for a policy
version. With `digests`, the receiver reads the tensors back from its own storage after the copy
and raises `WeightMismatch` naming those that differ (whether the engine can is its row's
`reads_back_weights`, checked when the config loads). A transport to separate rollout ranks (a
broadcast of the flat buffer over a process group, then the receiving rank's `update_weights`) is
one more file with this member.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from hybridrl.publication.buckets import BucketPlan, FlatBucket, InPlaceBucket


class WeightTransport(Protocol):
    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        """Deliver the bucket (or only `names` of it: a retry) for policy `version`."""


class InPlaceTransport:
    """A transport that may offer the engine's own storage as a publication's destination (declared by
    subclassing: `publish` asks only these). `structure` mode then writes the weights straight into
    the engine and commits each bucket: one copy instead of two."""

    def destination(self, plan: BucketPlan) -> InPlaceBucket | None:
        """The engine's own tensors for `plan`'s entries, or None when it offers none now."""
        raise NotImplementedError

    async def commit(self, bucket: InPlaceBucket, version: int) -> None:
        """Count the tensors written into `bucket` as arrived for `version`."""
        raise NotImplementedError
