"""Fixed-size buckets of (name, tensor) pairs that never split a fused group.

A fused group is what one training parameter becomes in the HF layout (e.g. q, k, v from one
`linear_qkv`; gate and up from one `linear_fc1`): either all of it is in a bucket or none. A
group larger than the bucket size travels alone.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def bucketize(groups: Iterable[Sequence[tuple[str, torch.Tensor]]], bucket_bytes: int) -> Iterator[NamedTensors]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for group in groups:
        group = list(group)
        group_size = sum(nbytes(t) for _, t in group)
        if bucket and size + group_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(group)
        size += group_size
    if bucket:
        yield bucket
