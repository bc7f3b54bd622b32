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

from typing import Any, Iterable, Mapping, Protocol, Sequence

from hybridrl.publication.buckets import BucketPlan, FlatBucket, InPlaceBucket
from hybridrl.publication.transport import InPlaceTransport


class InProcessEngine(Protocol):
    """What this transport needs of the engine (the native engine; a stand-in offers no views)."""

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int, *,
                             digests: Mapping[str, str] | None = None) -> None: ...

    def writable_views(self, names: Sequence[str]) -> dict[str, Any] | None: ...

    async def commit_in_place(self, names: Sequence[str], version: int) -> None: ...


class InProcessTransport(InPlaceTransport):
    def __init__(self, engine: InProcessEngine):
        self.engine = engine

    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        await self.engine.update_weights(bucket.named(names), version, digests=digests)

    def destination(self, plan: BucketPlan) -> InPlaceBucket | None:
        """The engine's own tensors for `plan`'s entries, when it lets a publisher write them in place."""
        views = self.engine.writable_views([e.name for e in plan.entries])
        return InPlaceBucket(plan, views) if views is not None else None

    async def commit(self, bucket: InPlaceBucket, version: int) -> None:
        await self.engine.commit_in_place(list(bucket.views), version)
