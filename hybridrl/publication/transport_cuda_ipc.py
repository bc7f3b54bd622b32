"""CUDA IPC transport into an in-process SGLang engine (GPU only; never run in this repo's CI).

Every rank of a rollout TP group holds the full HF tensors of the bucket on its own GPU (the
trainer gathered them). Each rank serialises CUDA IPC handles to its tensors; the handles are
gathered (gloo, small) to the group's first rank, which owns the SGLang engine and passes one
payload per SGLang TP rank, so SGLang TP rank i maps the tensors that live on its own GPU and
shards them itself. Source tensors must stay alive until the engine has loaded them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybridrl.publication.transport import NamedTensors


def _serializer():
    from sglang.srt.utils import MultiprocessingSerializer

    try:  # moved between 0.5.x releases
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        from sglang.srt.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()   # IPC handles carry the device UUID, not a local index
    return MultiprocessingSerializer


class CudaIpcTransport:
    def __init__(self, engine: Any, group_ranks: list[int], group: dist.ProcessGroup | None):
        """`engine`: the SGLangEngine on the group's first rank, a FollowerEngine on the others
        (both get `load_serialized(payloads, names, version)`; only the owner receives payloads)."""
        self.engine = engine
        self.group_ranks = group_ranks
        self.group = group
        self.owner = group_ranks[0]

    async def digests(self, bucket: NamedTensors) -> dict[str, str]:
        """The source tensors' digests (SGLang's scheduler processes cannot hash for us in 0.5.x; its
        weight checker is the receiving-side check where available)."""
        from hybridrl.publication.manifest import tensor_digest

        return {name: tensor_digest(name, t) for name, t in bucket}

    async def send(self, bucket: NamedTensors, version: int) -> None:
        bucket = [(name, t.detach().contiguous()) for name, t in bucket]
        if any(t.device.type != "cuda" for _, t in bucket):
            raise RuntimeError("CUDA IPC transport needs CUDA tensors")
        payload = _serializer().serialize(bucket, output_str=True)
        owner_here = not dist.is_initialized() or dist.get_rank() == self.owner
        gathered: list[Any] | None = [None] * len(self.group_ranks) if owner_here else None
        if len(self.group_ranks) > 1:
            dist.gather_object(payload, gathered, dst=self.owner, group=self.group)
        elif gathered is not None:
            gathered[0] = payload
        await self.engine.load_serialized(gathered, [n for n, _ in bucket], version)
        if len(self.group_ranks) > 1:
            dist.barrier(group=self.group)   # keep every rank's source tensors alive until loaded
        torch.cuda.ipc_collect()
