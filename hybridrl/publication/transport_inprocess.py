"""In-process transport: the rollout engine shares this process (the native engine).

Each bucket's views go to `engine.update_weights`, which validates the call whole, copies it into
the engine's existing storage (one copy per run of tensors that lie back to back on both sides)
and, given the sender's digests, hashes its own storage after the copy.

Where the engine offers its storage for writing (`writable_views`: the native engine, while it is
asleep) a publication that does not verify the copy (`publish.verify=structure`) writes straight
into it (`destination`) and commits each bucket (`commit`): one copy of the weights instead of two.
`post_copy` always copies from a bucket: its check compares the engine's storage with what was sent,
which would be the same memory written in place.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from hybridrl.publication.buckets import BucketPlan, FlatBucket, InPlaceBucket


class InProcessTransport:
    verifies = True

    def __init__(self, engine):
        self.engine = engine

    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        await self.engine.update_weights(bucket.named(names), version, digests=digests)

    def destination(self, plan: BucketPlan) -> InPlaceBucket | None:
        """The engine's own tensors for `plan`'s entries, when it lets a publisher write them in place."""
        offer = getattr(self.engine, "writable_views", None)
        views = offer([e.name for e in plan.entries]) if offer is not None else None
        return InPlaceBucket(plan, views) if views is not None else None

    async def commit(self, bucket: InPlaceBucket, version: int) -> None:
        await self.engine.commit_in_place(list(bucket.views), version)
