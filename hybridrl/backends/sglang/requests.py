"""The requests the SGLang backend sends, built against the pinned release's own types.

hybridrl pins one sglang release (`SGLANG_VERSION`, setup.py's `sglang` extra). Its request types
(`sglang.srt.managers.io_struct`) are msgspec Structs with keyword-only fields; weight updates
must run inside a session (`BeginWeightUpdateReqInput` ... `EndWeightUpdateReqInput`: the
scheduler refuses `update_weights_from_tensor` outside one); the serialized payloads are raw
`MultiprocessingSerializer` bytes, one per TP rank. Every function takes the `io_struct` module
(and, for buckets, the metadata class) as an argument, so the CPU tests build these requests
against the real types without a GPU.
"""

from __future__ import annotations

from typing import Any, Sequence

from hybridrl.publication.buckets import FlatBucket

SGLANG_VERSION = "0.5.21"
FLATTENED_BUCKET = "flattened_bucket"          # SGLang's load format for one flat buffer + metadata


def begin_update(io: Any) -> Any:
    return io.BeginWeightUpdateReqInput()


def end_update(io: Any) -> Any:
    return io.EndWeightUpdateReqInput()


def update_from_tensor(io: Any, payloads: Sequence[bytes], version: int, *, load_format: str | None) -> Any:
    """One bucket: `payloads[i]` is SGLang TP rank i's serialized bucket; the prefix cache is flushed
    once, when the whole version has arrived, not per bucket."""
    if not all(isinstance(p, bytes) for p in payloads):
        raise TypeError("serialized payloads must be bytes (MultiprocessingSerializer.serialize(..., output_str=False))")
    return io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=list(payloads), load_format=load_format,
                                              flush_cache=False, weight_version=str(version))


def release(io: Any, tags: Sequence[str]) -> Any:
    return io.ReleaseMemoryOccupationReqInput(tags=list(tags))


def resume(io: Any, tags: Sequence[str]) -> Any:
    return io.ResumeMemoryOccupationReqInput(tags=list(tags))


def pause(io: Any) -> Any:
    """Pause the scheduler's loop, retracting what still runs to the waiting queue (before a release)."""
    return io.PauseGenerationReqInput(mode="retract")


def resume_generation(io: Any) -> Any:
    return io.ContinueGenerationReqInput()


def bucket_payload(bucket: FlatBucket, metadata_cls: Any) -> dict[str, Any]:
    """A flat bucket as SGLang's flattened-bucket load format reads it: the uint8 buffer and, per
    tensor, its byte range (sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata)."""
    import torch

    return {"flattened_tensor": bucket.buffer,
            "metadata": [metadata_cls(name=e.name, shape=torch.Size(e.shape), dtype=e.dtype, start_idx=e.start,
                                      end_idx=e.end, numel=e.end - e.start) for e in bucket.plan.entries]}


def result_ok(result: Any) -> tuple[bool, str]:
    """(success, message) from what the tokenizer manager returns: a tuple, or an output Struct."""
    if isinstance(result, tuple):
        return bool(result[0]), str(result[1])
    return bool(getattr(result, "success", True)), str(getattr(result, "message", ""))
