"""Translation between our protocol and SGLang's request/response dictionaries (no sglang import).

Facts used (sglang 0.5.x, `managers/io_struct.py`, `entrypoints/engine.py`):
- sampling_params: max_new_tokens, temperature (0 = greedy), top_p, top_k (-1 = off),
  stop_token_ids, ignore_eos, no_stop_trim (True keeps the stop token, as our contract does),
  skip_special_tokens, sampling_seed (newer releases; omitted when no seed is given).
- meta_info.output_token_logprobs: [(logprob, token_id, text|None), ...]; meta_info.finish_reason:
  {"type": "stop", "matched": id} | {"type": "length", "length": n} | {"type": "abort", ...}.
- Its logprobs are log_softmax(logits / T) over the full vocabulary before top-k/top-p (our
  sampler contract v1); greedy returns the raw log_softmax.
- meta_info.routed_experts (server flag enable_return_routed_experts, request flag
  return_routed_experts; MoE models): the top-k expert ids of every token the engine computed,
  prompt + output but the last output token, for every hidden layer (dense layers' rows carry no
  meaning), as base64 of int32 [tokens - 1, num_hidden_layers, top_k] (a plain list in some
  releases).
"""

from __future__ import annotations

from typing import Any, Mapping

from hybridrl.rollout.protocol import FinishReason, GenerationOutput, GenerationTimings, SamplingParams


def sampling_params(sampling: SamplingParams, eos_token_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop_token_ids": sorted(set(sampling.stop_token_ids) | set(() if sampling.ignore_eos else eos_token_ids)),
        "ignore_eos": sampling.ignore_eos,
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def finish_reason(meta: Mapping[str, Any], num_tokens: int, max_new_tokens: int) -> FinishReason:
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, Mapping) else str(reason)
    if kind == "stop":
        return FinishReason.STOP
    if kind == "length":
        return FinishReason.LENGTH if num_tokens >= max_new_tokens else FinishReason.CONTEXT
    if kind == "abort":
        return FinishReason.ABORT
    raise ValueError(f"unrecognised SGLang finish_reason {reason!r}")


def routed_experts(meta: Mapping[str, Any], *, num_positions: int, routing: Any):
    """SGLang's routing record as ours: the sparse layers' rows, [num_positions, moe_layers, top_k] in
    the spec's routing dtype; None when the response has none. `routing` is the model's `ModelSpec`."""
    blob = meta.get("routed_experts")
    if blob is None:
        return None
    import base64

    import numpy as np
    import torch

    if isinstance(blob, (str, bytes)):
        flat = np.frombuffer(base64.b64decode(blob), dtype=np.int32)
    else:
        flat = np.asarray(blob, dtype=np.int32).reshape(-1)
    width = routing.num_layers * routing.num_experts_per_tok
    if flat.size != num_positions * width:
        raise ValueError(f"SGLang routed_experts holds {flat.size} ids, expected {num_positions} tokens x "
                         f"{routing.num_layers} layers x top-{routing.num_experts_per_tok}")
    table = flat.reshape(num_positions, routing.num_layers, routing.num_experts_per_tok)[:, list(routing.moe_layers)]
    return torch.from_numpy(np.ascontiguousarray(table)).to(routing.routing_dtype)


def generation_output(out: Mapping[str, Any], *, request_id: str, policy_version: int, prompt_tokens: int,
                      max_new_tokens: int, timings: GenerationTimings, routing: Any = None,
                      routing_start: int = 0) -> GenerationOutput:
    """Build our output from SGLang's, taking ids and logprobs from the same logprob records. With
    `routing_start` (the request's routed_experts_start_len) the routing rows are those of positions
    [routing_start, prompt + output - 1) only."""
    meta = out.get("meta_info", {})
    records = meta.get("output_token_logprobs") or []
    token_ids = [int(r[1]) for r in records]
    logprobs = [float(r[0]) for r in records]
    output_ids = out.get("output_ids")
    if output_ids is not None and list(output_ids) != token_ids:
        raise ValueError(f"request {request_id}: SGLang output_ids and logprob records disagree "
                         f"({len(output_ids)} vs {len(token_ids)} tokens)")
    routed = (routed_experts(meta, num_positions=prompt_tokens + len(token_ids) - 1 - routing_start, routing=routing)
              if routing is not None else None)
    return GenerationOutput(
        request_id=request_id, token_ids=token_ids, logprobs=logprobs,
        finish_reason=finish_reason(meta, len(token_ids), max_new_tokens),
        policy_version=policy_version, prompt_tokens=prompt_tokens,
        cached_prompt_tokens=int(meta.get("cached_tokens", 0) or 0), timings=timings, routed_experts=routed)
