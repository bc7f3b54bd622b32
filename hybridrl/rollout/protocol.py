"""The rollout-engine protocol: token ids in, token ids + exact logprobs + policy version out.

Every backend (`backends/native`, `backends/sglang`) implements `RolloutEngine`; the agent
loop and the hybrid worker only ever see this. Text never crosses this boundary: callers
render prompts to ids once and decode ids only to parse or display.

The meaning of the returned logprobs is fixed by the sampler contract (`SAMPLER_CONTRACT`),
versioned so that a trainer can check it recomputes the same quantity.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import torch

SAMPLER_CONTRACT_VERSION = 1

SAMPLER_CONTRACT = """\
Sampler contract v1 (what a returned logprob means)
1. logits = model(prefix)[-1] in float32, over the model's full vocabulary (config.vocab_size).
2. Greedy (temperature == 0): token = argmax(logits), ties to the lowest id;
   logprob = log_softmax(logits)[token] (temperature 1, no filtering).
3. Sampling: scaled = logits / temperature; logprob = log_softmax(scaled)[token], over the FULL
   vocabulary, before top-k / top-p filtering (the same quantity SGLang returns). top-k keeps
   the k largest scaled logits, then top-p keeps the smallest prefix of those, sorted by
   probability, whose mass reaches top_p (always at least one token); the token is drawn from
   the renormalised filtered distribution with the request's own generator (seeded when a seed
   is given). No repetition penalties, logit bias or grammar masks are applied in v1.
4. A trainer that recomputes behaviour logprobs must therefore compute
   log_softmax(logits / temperature) at the sampled token (temperature 1 for greedy) and must
   treat top-k/top-p as a truncation of the behaviour policy it does not model.
"""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0          # 0 = greedy
    top_k: int = -1                   # -1 = off
    top_p: float = 1.0                # 1.0 = off
    seed: int | None = None           # per-request generator; None = engine's generator
    stop_token_ids: tuple[int, ...] = ()   # in addition to the model's EOS ids; the stop token is kept
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FinishReason(str, enum.Enum):
    STOP = "stop"                  # EOS or a stop token was generated (it is the last output token)
    LENGTH = "length"              # max_new_tokens reached
    CONTEXT = "context"            # the model's context length reached
    ABORT = "abort"                # abort(request_id), or the engine was put to sleep
    WEIGHTS_UPDATED = "weights_updated"   # aborted because new weights arrived mid-request


@dataclass(frozen=True)
class GenerationTimings:
    queued_s: float = 0.0          # submit -> first scheduled
    first_token_s: float = 0.0     # submit -> first output token
    total_s: float = 0.0           # submit -> finished


@dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    token_ids: list[int]           # generated ids only (not the prompt)
    logprobs: list[float]          # one per generated id, per the sampler contract
    finish_reason: FinishReason
    policy_version: int            # the weights the first token of this output was generated with
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    timings: GenerationTimings = field(default_factory=GenerationTimings)
    # MoE models: the expert ids each token of prompt + output was routed to, a CPU tensor
    # [positions, moe_layers, top_k] (int8, or int16 above 128 experts) covering every token the
    # engine computed (all but the last output token); None for dense models / engines without it
    routed_experts: Any = None
    sampler_contract: int = SAMPLER_CONTRACT_VERSION
    # an engine that applies new weights between its steps while the request runs (the native engine's
    # on_weight_update=continue): (index into token_ids, version) where each later version's tokens begin,
    # in order; empty when every token is `policy_version`'s. `by_version` splits such an output.
    version_starts: tuple[tuple[int, int], ...] = ()

    @property
    def versions(self) -> list[int]:
        """The policy version of every generated token."""
        out, version, starts = [], self.policy_version, list(self.version_starts)
        for i in range(len(self.token_ids)):
            while starts and starts[0][0] <= i:
                version = starts.pop(0)[1]
            out.append(version)
        return out

    def by_version(self) -> list["GenerationOutput"]:
        """One output per version, in order (a segment each: its tokens, logprobs and version). The earlier
        ones end with WEIGHTS_UPDATED, the last with this output's reason; the routing record goes to the last,
        which covers every position (the latest record of a position wins)."""
        bounds = [(0, self.policy_version), *self.version_starts]
        while len(bounds) > 1 and bounds[-1][0] >= len(self.token_ids):    # an update after its last token
            bounds.pop()
        if len(bounds) == 1:
            return [dataclasses.replace(self, version_starts=())] if self.version_starts else [self]
        parts = []
        for k, (start, version) in enumerate(bounds):
            end = bounds[k + 1][0] if k + 1 < len(bounds) else len(self.token_ids)
            last = k + 1 == len(bounds)
            parts.append(dataclasses.replace(
                self, token_ids=self.token_ids[start:end], logprobs=self.logprobs[start:end], policy_version=version,
                finish_reason=self.finish_reason if last else FinishReason.WEIGHTS_UPDATED,
                prompt_tokens=self.prompt_tokens + start,
                cached_prompt_tokens=self.cached_prompt_tokens if k == 0 else 0, routed_experts=self.routed_experts if last else None,
                version_starts=()))
        return [p for p in parts if p.token_ids]


# What an engine can release between modes and take back (`sleep(tags)` / `wake_up(tags)`); each
# engine declares the subset it implements in `releasable_tags`.
WEIGHTS = "weights"          # released weights are discarded: every tensor must be published again
KV_CACHE = "kv_cache"        # the KV cache (and the prefix cache with it)
CUDA_GRAPH = "cuda_graph"    # captured CUDA graphs' memory
MEMORY_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the agent loop and the hybrid worker use. All coroutines run on one event loop.

    Semantics every backend keeps:
    - `generate`: cancelling the awaiting task aborts the request inside the engine.
    - `update_weights`: each call is validated whole (names, shapes, dtypes) before any copy, so a
      bad call changes nothing; the policy version changes only when every tensor of the
      backend's weight set has arrived for that version (one version may come in several calls);
      with `digests` (the sender's `tensor_digest` of each tensor) the engine reads every tensor
      back from its own storage after the copy and counts only the matching ones as arrived,
      raising `WeightMismatch` naming the others; requests in flight either finish on the version
      they started with, end with FinishReason.WEIGHTS_UPDATED, or (an engine that can) go on under
      the new weights with their later tokens labelled by `version_starts` (the backend says which);
      no token is ever generated from a partly updated model.
    - `sleep(tags)`: releases the named memory (`releasable_tags` says which the engine can);
      requests in flight end with FinishReason.ABORT first. Released weights are gone: the
      version becomes -1 until a whole version is published again. `wake_up(tags)` takes the
      memory back.
    """

    @property
    def policy_version(self) -> int: ...

    @property
    def releasable_tags(self) -> frozenset[str]: ...

    @property
    def eos_token_ids(self) -> Sequence[int]:
        """The ids that end a generation (the model's EOS ids; the agent loop closes turns with them)."""

    @property
    def max_model_len(self) -> int | None:
        """The longest prompt + output the engine serves (None or 0: no limit known)."""

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str) -> GenerationOutput: ...

    async def abort(self, request_id: str) -> bool:
        """Abort one request; it finishes with FinishReason.ABORT. False if unknown/finished."""

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             digests: Mapping[str, str] | None = None) -> None:
        """Copy HF-named tensors into the live weights; the version changes only when all arrived."""

    async def sleep(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        """Release the tagged memory (requests in flight end with ABORT)."""

    async def wake_up(self, tags: Iterable[str] = (KV_CACHE,)) -> None: ...

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def check_tags(engine: Any, tags: Iterable[str]) -> list[str]:
    """The tags as a list, refusing any the engine cannot release (a ValueError naming them)."""
    tags = list(dict.fromkeys(tags))
    unknown = [t for t in tags if t not in engine.releasable_tags]
    if unknown:
        raise ValueError(f"{type(engine).__name__} cannot release {unknown}: it releases "
                         f"{sorted(engine.releasable_tags)}")
    return tags
