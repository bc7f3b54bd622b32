"""CUDA IPC transport of flat buckets into an in-process SGLang engine (GPU only).

Every rank of a rollout TP group holds the bucket (one flat buffer) on its own GPU. Each rank
serialises a CUDA IPC handle to its buffer with the bucket's metadata (SGLang's flattened-bucket
format: one handle per bucket, not one per tensor); the payloads are gathered (gloo, small) to the
group's first rank, which owns the SGLang engine and passes one payload per SGLang TP rank, so
TP rank i maps the buffer on its own GPU and shards the tensors itself. The buffers stay alive
(and unwritten) until every rank has passed the barrier after the load.

SGLang's weights live in its scheduler processes in its own fused layout, so this transport
cannot read them back after the copy (its row: `reads_back_weights=False`): publish with `publish.verify=structure`;
the parity probe checks the contents.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from hybridrl.backends.sglang import requests
from hybridrl.publication.buckets import FlatBucket


def serialize_bucket(bucket: FlatBucket) -> bytes:
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

    monkey_patch_torch_reductions()   # IPC handles carry the device UUID, not a local index
    return MultiprocessingSerializer.serialize(requests.bucket_payload(bucket, FlattenedTensorMetadata))


class CudaIpcTransport:
    def __init__(self, engine: Any, group_ranks: list[int], group: dist.ProcessGroup | None):
        """`engine`: the SGLangEngine on the group's first rank, a FollowerEngine on the others
        (both get `load_serialized(payloads, names, version, load_format=...)`; only the owner gets payloads)."""
        self.engine = engine
        self.group_ranks = group_ranks
        self.group = group
        self.owner = group_ranks[0]

    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        if digests is not None or names is not None:
            raise ValueError("the CUDA IPC transport cannot verify after the copy: use publish.verify=structure")
        if bucket.buffer.device.type != "cuda":
            raise RuntimeError("the CUDA IPC transport needs the bucket on a CUDA device")
        payload = serialize_bucket(bucket)
        owner_here = not dist.is_initialized() or dist.get_rank() == self.owner
        gathered: list[Any] | None = [None] * len(self.group_ranks) if owner_here else None
        if len(self.group_ranks) > 1:
            dist.gather_object(payload, gathered, dst=self.owner, group=self.group)
        elif gathered is not None:
            gathered[0] = payload
        await self.engine.load_serialized(gathered, list(bucket.views), version,
                                          load_format=requests.FLATTENED_BUCKET)
        if len(self.group_ranks) > 1:
            dist.barrier(group=self.group)   # keep every rank's buffer alive until the engine loaded it
        torch.cuda.ipc_collect()
