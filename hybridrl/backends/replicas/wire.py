"""What travels between the trainer's `ReplicasEngine` and a replica server, in both directions.

    a generation request   JSON: token ids, the sampling parameters (seed included), the request id
    its answer             JSON: a `GenerationOutput` field by field (logprobs as JSON numbers: a float
                           written by Python's json reads back to the same bits), the routing record of a
                           mixture-of-experts model as base64 bytes with its shape and dtype
    a weight bucket        the safetensors format: an 8-byte header length, a JSON header (each tensor's
                           dtype, shape and byte range; `__metadata__` holds the version and the sender's
                           digests and the sending client's id), then the bytes. Written here rather than by `safetensors.torch.save`,
                           which refuses tensors that share storage, as a bucket's views of one flat buffer do
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
from typing import Any, Iterable, Mapping

import torch

from hybridrl.rollout.protocol import FinishReason, GenerationOutput, GenerationTimings, SamplingParams
from hybridrl.rollout.weight_spec import dtype_name

# torch dtype -> the safetensors name (those a published model holds)
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def sampling_to_json(sampling: SamplingParams) -> dict[str, Any]:
    return {**dataclasses.asdict(sampling), "stop_token_ids": list(sampling.stop_token_ids)}


def sampling_from_json(body: Mapping[str, Any]) -> SamplingParams:
    return SamplingParams(**{**body, "stop_token_ids": tuple(body.get("stop_token_ids", ()))})


def _tensor_to_json(t: torch.Tensor | None) -> dict[str, Any] | None:
    if t is None:
        return None
    t = t.detach().cpu().contiguous()
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype),
            "data": base64.b64encode(t.view(-1).view(torch.uint8).numpy().tobytes()).decode()}


def _tensor_from_json(body: Mapping[str, Any] | None) -> torch.Tensor | None:
    if body is None:
        return None
    raw = bytearray(base64.b64decode(body["data"]))
    dtype = getattr(torch, body["dtype"])
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(body["shape"])


def output_to_json(out: GenerationOutput) -> dict[str, Any]:
    return {"request_id": out.request_id, "token_ids": list(out.token_ids), "logprobs": list(out.logprobs),
            "finish_reason": out.finish_reason.value, "policy_version": out.policy_version,
            "prompt_tokens": out.prompt_tokens, "cached_prompt_tokens": out.cached_prompt_tokens,
            "timings": dataclasses.asdict(out.timings), "routed_experts": _tensor_to_json(out.routed_experts),
            "sampler_contract": out.sampler_contract, "version_starts": [list(v) for v in out.version_starts]}


def output_from_json(body: Mapping[str, Any]) -> GenerationOutput:
    return GenerationOutput(
        request_id=body["request_id"], token_ids=[int(t) for t in body["token_ids"]],
        logprobs=[float(x) for x in body["logprobs"]], finish_reason=FinishReason(body["finish_reason"]),
        policy_version=int(body["policy_version"]), prompt_tokens=int(body["prompt_tokens"]),
        cached_prompt_tokens=int(body["cached_prompt_tokens"]), timings=GenerationTimings(**body["timings"]),
        routed_experts=_tensor_from_json(body["routed_experts"]), sampler_contract=int(body["sampler_contract"]),
        version_starts=tuple((int(i), int(v)) for i, v in body["version_starts"]))


def weights_payload(named: Iterable[tuple[str, torch.Tensor]], version: int,
                    digests: Mapping[str, str] | None, client: str = "") -> bytes:
    """One bucket (or the part of it being sent again) as a safetensors file's bytes."""
    header: dict[str, Any] = {"__metadata__": {"version": str(version), "client": client,
                                               "digests": json.dumps(dict(digests)) if digests is not None else ""}}
    parts, offset = [], 0
    for name, tensor in named:
        raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8)
        header[name] = {"dtype": _ST_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + raw.numel()]}
        parts.append(raw)
        offset += raw.numel()
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)                       # the format aligns the data to 8 bytes
    body = torch.cat(parts).numpy().tobytes() if parts else b""
    return struct.pack("<Q", len(head)) + head + body


def read_weights(payload: bytes) -> tuple[list[tuple[str, torch.Tensor]], int, dict[str, str] | None, str]:
    """(named tensors in the order sent, version, the sender's digests or None, the client) of
    `weights_payload`'s bytes."""
    from safetensors.torch import load

    (size,) = struct.unpack("<Q", payload[:8])
    header = json.loads(payload[8:8 + size])
    meta = header.pop("__metadata__")
    tensors = load(payload)
    digests = json.loads(meta["digests"]) if meta["digests"] else None
    return [(name, tensors[name]) for name in header], int(meta["version"]), digests, meta.get("client", "")
