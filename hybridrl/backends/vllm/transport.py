"""Flat buckets into this rank's vLLM engine, one collective RPC per bucket, and how a bucket crosses
vLLM's RPC (`bucket_wire`, `pack_bucket`).

The bucket's buffer travels whole with its layout (names, shapes, dtypes, byte offsets) to vLLM's
worker process (on CPU as one out-of-band frame of vLLM's RPC encoder, on CUDA as an IPC handle of
the buffer), where `worker.WeightSync` makes the views, copies them into the parameters in place
and, with the sender's digests, hashes its own storage of each: the engine raises `WeightMismatch`
for those that differ (publish.verify=post_copy) and counts only the others as arrived.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from hybridrl.publication.buckets import FlatBucket


class BucketRpcTransport:
    def __init__(self, engine: Any):
        self.engine = engine

    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        if digests is not None and names is not None:
            digests = {n: digests[n] for n in names}
        await self.engine.load_bucket(bucket, version, names=names, digests=digests)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU tensor's bytes. Tensors cross vLLM's RPC as bytes: its engine core decodes a utility call's
    arguments without their types, so a tensor would arrive as a [dtype, shape, buffer index] list whose
    out-of-band buffer is already gone."""
    flat = tensor.detach().contiguous().view(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def bucket_wire(buffer: torch.Tensor) -> tuple[str, Any]:
    """How a flat bucket's buffer crosses vLLM's RPC: ("raw", its bytes) from the CPU, ("cuda_ipc", a pickled
    IPC handle naming the GPU by UUID, `ipc.share`) from a GPU; a buffer anywhere else is refused (`.numpy()`
    of a device tensor would fail later, inside the RPC)."""
    import pickle

    from hybridrl.backends.vllm import ipc

    if buffer.device.type == "cpu":
        return "raw", raw_bytes(buffer)
    if buffer.device.type == "cuda":
        return "cuda_ipc", pickle.dumps(ipc.share(buffer))
    raise ValueError(f"a vLLM publication comes from the CPU or a CUDA GPU, not from {buffer.device}")


def pack_bucket(items: Sequence[tuple[str, torch.Tensor]]) -> Any:
    """(name, tensor) pairs copied into one flat bucket on their device (element-aligned offsets)."""
    from hybridrl.publication.buckets import FlatBucket, plan_buckets

    if not items:
        raise ValueError("pack_bucket: no tensors")
    specs = [(n, tuple(t.shape), t.dtype) for n, t in items]
    total = sum(t.numel() * t.element_size() for _, t in items) + 16 * len(items)
    plan, = plan_buckets([specs], total)
    bucket = FlatBucket(plan, torch.empty(plan.nbytes, dtype=torch.uint8, device=items[0][1].device))
    for name, tensor in items:
        bucket.views[name].copy_(tensor)
    return bucket
