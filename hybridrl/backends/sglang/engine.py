"""`SGLangEngine`: the RolloutEngine protocol over an in-process `sglang.Engine` (GPU extra).

Written against the pinned sglang release (`requests.SGLANG_VERSION`) from its source; it has not
run on a GPU yet. Generation through `async_generate(input_ids=..., return_logprob=True, rid=...)`;
everything else through the tokenizer manager's coroutines (the Engine's own sync wrappers call
`run_until_complete` and cannot be used inside our event loop), which bind to the first event loop
that uses them: one engine, one loop, for its whole life. Memory by tags ("weights", "kv_cache",
"cuda_graph"; `release/resume_memory_occupation`); weights through `update_weights_from_tensor`
inside a weight-update session (begin at a version's first bucket, end once every tensor has
arrived, then `flush_cache`), one payload serialized for each TP rank (each rank deserializes its
own copy, so the CUDA IPC reference counts drop cleanly after every load: sglang's own
`Engine._serialize_tensors_per_rank`, entrypoints/engine.py:1656-1672). Mixture-of-experts models:
the server records routing (`enable_return_routed_experts`) and every request returns it
(`return_routed_experts`), as `GenerationOutput.routed_experts` (routing replay); a later turn of an
episode asks only for the rows after what an earlier turn returned (`routed_experts_start_len`,
`routing.RoutingMemory`) and still returns the whole record.

Starting the engine changes the trainer's process (environment, signal handlers, start method):
`launch.py` isolates and restores them; the tokenizer manager's signal handlers come off our event
loop on the engine's first coroutine (`_bind`).

`max_model_len` is what sglang resolved, not the raw `context_length` knob: the tokenizer manager's
context length (the model's, or the knob) less its reserved tokens, and the scheduler's longest
input (also capped by the KV pool) (managers/tokenizer_manager.py:550,1286-1331, tp_worker.py:544-548).
The agent loop ends an episode TRUNCATED at it instead of sglang raising on a long one.

Per-request sampling seeds (`SamplingParams.seed`) take effect only with sglang's deterministic
inference (`rollout.sglang.deterministic_inference`; sampling/sampling_batch_info.py:143-157): without
it sglang samples each request from its own generator state and rollouts are not reproducible.

Lifecycle in the hybrid worker: start with dummy weights; per rollout: resume weights -> push every
bucket (the version switches when all arrived) -> resume KV cache and CUDA graphs -> generate ->
abort, drain, release all. SGLang asserts its server is idle when memory is released (the
assertion ends its scheduler process), so `sleep` never releases while one of our requests is
still running: past `drain_timeout_s` it raises instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from hybridrl.backends.model_spec import checkpoint_shapes, eos_token_ids
from hybridrl.backends.sglang import convert, launch, requests, routing
from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.publication.manifest import PublicationError
from hybridrl.rollout.protocol import (
    CUDA_GRAPH,
    KV_CACHE,
    WEIGHTS,
    GenerationOutput,
    GenerationTimings,
    SamplingParams,
    check_tags,
)
from hybridrl.rollout.versions import Publication
from hybridrl.rollout.weight_spec import validate_named_tensors

log = logging.getLogger(__name__)


def checkpoint_spec(model_dir: str | Path, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF tensor names and shapes from the safetensors headers (no data read), in the engine dtype."""
    return {name: (shape, dtype) for name, shape in checkpoint_shapes(model_dir).items()}


class SGLangEngine:
    def __init__(self, model_path: str, cfg: SGLangConfig, *, tp_size: int = 1, base_gpu_id: int = 0,
                 port_offset: int = 0, seed: int = 0, max_model_len: int | None = None,
                 drain_timeout_s: float = 60.0):
        import sglang

        from hybridrl.backends.model_spec import ModelSpec

        self.cfg = cfg
        self.tp_size = tp_size
        spec = ModelSpec.from_dir(model_path)
        self._routing = spec if spec.is_moe else None      # MoE: record and return each token's experts
        self._routes = routing.RoutingMemory()             # MoE: what was returned, so each turn gets new rows only
        self.dtype = getattr(torch, cfg.dtype)
        self.drain_timeout_s = drain_timeout_s
        self.releasable_tags = cfg.releasable_tags()
        if CUDA_GRAPH in self.releasable_tags:
            os.environ.setdefault("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "true")   # read by the scheduler processes
        with launch.launch_scope() as self._trainer_signals:
            self._engine = sglang.Engine(**engine_kwargs(model_path, cfg, tp_size=tp_size, base_gpu_id=base_gpu_id,
                                                         port_offset=port_offset, seed=seed,
                                                         routed_experts=self._routing is not None))
        self._tm = self._engine.tokenizer_manager
        self._bound = False              # the tokenizer manager is bound to our loop (see `_bind`)
        self._seed_warned = cfg.deterministic_inference
        self._spec = checkpoint_spec(model_path, self.dtype)
        self._publication = Publication(self._spec, -1 if cfg.load_format == "dummy" else 0)
        self._released: set[str] = set()
        self._in_flight: set[str] = set()
        self._session = False            # a weight-update session is open in the scheduler
        self._paused = False             # the scheduler's loop is paused (sleep), until everything is awake
        self.eos_token_ids = tuple(sorted(eos_token_ids(model_path)))
        self.max_model_len = resolved_max_model_len(max_model_len, self._tm)

    # ---------------------------------------------------------------- as a registered rollout engine

    serves_before_publication = False        # dummy weights until the first publication (version -1)

    @classmethod
    def for_rank(cls, cfg: Any, ctx: Any) -> "SGLangEngine":
        """The rollout group's engine on its first rank: `rollout.sglang`'s knobs, TP over `rollout.tp` GPUs
        starting at this rank's, ports offset by the rank."""
        return cls(cfg.model.path, cfg.rollout.sglang, tp_size=cfg.rollout.tp, base_gpu_id=ctx.local_rank,
                   port_offset=ctx.rank, seed=cfg.run.seed, drain_timeout_s=cfg.hybrid.drain_deadline_s)

    @classmethod
    def releasable_tags_for(cls, cfg: Any) -> frozenset[str]:
        return frozenset(cfg.rollout.sglang.releasable_tags())

    @classmethod
    def colocated_transport(cls, engine: Any, ranks: Sequence[int], group: Any) -> Any:
        """CUDA IPC handles of every rank's flat bucket, gathered to the engine on the group's first rank
        (`engine` is this rank's: the group's engine there, its follower stand-in elsewhere)."""
        from hybridrl.backends.sglang.transport import CudaIpcTransport

        return CudaIpcTransport(engine, list(ranks), group)

    # ---------------------------------------------------------------- protocol

    @property
    def policy_version(self) -> int:
        return self._publication.version

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._spec)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> GenerationOutput:
        if self.policy_version < 0:
            raise RuntimeError("SGLang engine has no weights yet: publish a policy before generating")
        if self._released or self._paused:
            raise RuntimeError("SGLang engine is asleep: call wake_up() before generating")
        await self._bind()
        if sampling.seed is not None and not self._seed_warned:
            self._seed_warned = True
            log.warning("SGLang ignores per-request sampling seeds without deterministic inference: set "
                        "rollout.sglang.deterministic_inference=true for reproducible rollouts")
        version = self.policy_version
        prompt = list(token_ids)
        start, known, entry = self._routes.lookup(prompt) if self._routing is not None else (0, None, None)
        started = time.perf_counter()
        self._in_flight.add(request_id)
        try:
            out = await self._engine.async_generate(
                input_ids=prompt, sampling_params=convert.sampling_params(sampling, self.eos_token_ids),
                return_logprob=True, rid=request_id,
                **({"return_routed_experts": True, "routed_experts_start_len": start}
                   if self._routing is not None else {}))
        finally:
            self._in_flight.discard(request_id)
        total = time.perf_counter() - started
        if self.policy_version != version:
            raise RuntimeError(f"request {request_id} spans a weight update (v{version} -> v{self.policy_version})")
        result = convert.generation_output(out, request_id=request_id, policy_version=version,
                                           prompt_tokens=len(prompt), max_new_tokens=sampling.max_new_tokens,
                                           timings=GenerationTimings(total_s=total), routing=self._routing,
                                           routing_start=start)
        if self._routing is None:
            return result
        whole = routing.joined(known, result.routed_experts)
        self._routes.remember(prompt + result.token_ids, whole, replaces=entry)
        return dataclasses.replace(result, routed_experts=whole)

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._in_flight:
            return False
        self._tm.abort_request(rid=request_id)
        return True

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             digests: Mapping[str, str] | None = None) -> None:
        """Validated whole against the checkpoint's names, shapes and the engine dtype before anything
        is sent (a bad call changes nothing), then pushed as (name, tensor) pairs over CUDA IPC."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        if digests is not None:
            raise ValueError("the SGLang engine cannot read its weights back after the copy (they live in its "
                             "scheduler processes, in its own layout): publish with publish.verify=structure")
        items = list(named_tensors)
        validate_named_tensors(items, self._spec)
        self._publication.check(version)
        monkey_patch_torch_reductions()   # IPC handles carry the device UUID, not a local index
        named = [(n, t.detach().contiguous()) for n, t in items]
        payloads = [MultiprocessingSerializer.serialize(named) for _ in range(self.tp_size)]   # one per TP rank
        await self.load_serialized(payloads, [n for n, _ in items], version)
        torch.cuda.ipc_collect()

    async def load_serialized(self, payloads: list[bytes], names: list[str], version: int, *,
                              load_format: str | None = None) -> None:
        """Load one bucket: `payloads[i]` is SGLang TP rank i's serialized bucket."""
        from sglang.srt.managers import io_struct

        await self._bind()
        unknown = sorted(set(names) - set(self._spec))
        if unknown:
            raise PublicationError(f"unknown tensor(s) for this engine: {unknown[:5]}")
        if WEIGHTS in self._released:
            raise RuntimeError("the weights are released: wake_up(['weights']) before publishing")
        self._publication.check(version)
        if not self._session:
            await self._expect(self._tm.begin_weight_update(requests.begin_update(io_struct), None),
                               "begin_weight_update")
            self._session = True
        result = await self._tm.update_weights_from_tensor(
            requests.update_from_tensor(io_struct, payloads, version, load_format=load_format), None)
        ok, message = requests.result_ok(result)
        if not ok:
            raise PublicationError(f"SGLang refused a bucket of v{version}: {message}")
        if self._publication.completes(names, version):
            await self._expect(self._tm.end_weight_update(requests.end_update(io_struct), None), "end_weight_update")
            self._session = False
            await self._flush()        # before the version switches: no request sees stale KV
        self._publication.arrive(names, version)

    async def sleep(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        """Abort the requests in flight (they end with FinishReason.ABORT), wait until they have ended
        (at most `drain_timeout_s`: SGLang's scheduler asserts it is idle when memory is released, so
        it never releases under a running request; past the timeout this raises), pause the scheduler
        (retract), then release the tagged memory. Released weights are gone: the version becomes -1.
        The scheduler runs again once `wake_up` has taken every tag back."""
        await self._bind()
        tags = [t for t in check_tags(self, tags) if t not in self._released]
        if not tags:
            return
        for rid in list(self._in_flight):
            self._tm.abort_request(rid=rid)
        deadline = time.monotonic() + self.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._in_flight:
            raise RuntimeError(f"SGLang engine: {len(self._in_flight)} aborted request(s) still running after "
                               f"{self.drain_timeout_s:g}s (hybrid.drain_deadline_s); memory not released, "
                               "since SGLang's scheduler asserts it is idle when it releases")
        from sglang.srt.managers import io_struct

        if not self._paused:
            # Our requests have returned, but with the overlap scheduler the scheduler may still hold its last
            # batch for one iteration; retract pauses its loop after processing that batch and moves whatever
            # still runs back to the waiting queue, which the release's idle check then ignores (sglang 0.5.21
            # managers/scheduler.py:5589-5618, managers/scheduler_components/weight_updater.py:318-322).
            await self._tm.pause_generation(requests.pause(io_struct))
            self._paused = True
        self._routes.clear()
        before = device_memory_used()
        await self._tm.release_memory_occupation(requests.release(io_struct, tags), None)
        record_memory("release", tags, before, device_memory_used())
        self._released.update(tags)
        if WEIGHTS in tags:
            self._publication.forget()

    async def wake_up(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        from sglang.srt.managers import io_struct

        await self._bind()
        tags = [t for t in check_tags(self, tags) if t in self._released]
        if tags:
            before = device_memory_used()
            await self._tm.resume_memory_occupation(requests.resume(io_struct, tags), None)
            record_memory("resume", tags, before, device_memory_used())
            self._released.difference_update(tags)
        if self._paused and not self._released:
            # everything is back: the scheduler runs again (its tokenizer manager holds new requests while
            # paused, managers/tokenizer_manager.py:895, 2155-2159)
            await self._tm.continue_generation(requests.resume_generation(io_struct))
            self._paused = False

    def stats(self) -> dict[str, Any]:
        return {"policy_version": self.policy_version, "released": sorted(self._released),
                "requests_in_flight": len(self._in_flight), "tp_size": self.tp_size}

    def close(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes (idempotent). sglang's `shutdown` kills
        every child process of this process (entrypoints/engine.py:1406), not only its own: close the
        engine after the tools and services whose processes should end on their own terms."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # ---------------------------------------------------------------- internals

    async def _bind(self) -> None:
        """Bind the tokenizer manager to the running loop now (what its first coroutine would do) and
        take the signal handlers it adds there off again, restoring the trainer's (`launch.py`)."""
        if self._bound:
            return
        self._tm.auto_create_handle_loop()
        launch.release_loop_signals(asyncio.get_running_loop(), self._trainer_signals)
        self._bound = True

    async def _expect(self, call, what: str) -> None:
        ok, message = requests.result_ok(await call)
        if not ok:
            raise PublicationError(f"SGLang {what} failed: {message}")

    async def _flush(self) -> None:
        for _ in range(100):
            result = await self._tm.flush_cache()
            if getattr(result, "success", True):
                return
            await asyncio.sleep(0.05)   # flush fails while requests are pending
        raise RuntimeError("SGLang flush_cache kept failing after a weight update")


MEMORY_LOG = "HYBRIDRL_SGLANG_MEMORY_LOG"      # a file: one JSON line per release / resume (first contact)


def device_memory_used() -> int | None:
    """Bytes in use on this process's GPU, by every process (SGLang's schedulers included); None off CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def record_memory(op: str, tags: Sequence[str], before: int | None, after: int | None) -> None:
    """Log the device memory around a release / resume (and append it to $HYBRIDRL_SGLANG_MEMORY_LOG)."""
    event = {"op": op, "tags": sorted(tags), "used_before": before, "used_after": after}
    log.info("SGLang %s %s: device memory in use %s -> %s", op, event["tags"], before, after)
    path = os.environ.get(MEMORY_LOG)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def resolved_max_model_len(requested: int | None, tokenizer_manager: Any) -> int | None:
    """The longest prompt + output this engine takes (see the module doc): the smallest of what was
    asked for, the resolved context length less the reserved tokens, and the scheduler's longest
    input; None when sglang reports none of them."""
    context = int(getattr(tokenizer_manager, "context_len", 0) or 0)
    reserved = int(getattr(tokenizer_manager, "num_reserved_tokens", 0) or 0)
    longest_input = int(getattr(tokenizer_manager, "max_req_input_len", 0) or 0)
    limits = [n for n in (requested or 0, context - reserved if context else 0, longest_input) if n > 0]
    return min(limits) if limits else None


def engine_kwargs(model_path: str, cfg: SGLangConfig, *, tp_size: int, base_gpu_id: int, port_offset: int,
                  seed: int, routed_experts: bool = False) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for one engine of a rollout group (unique ports per engine)."""
    kwargs: dict[str, Any] = dict(
        model_path=model_path, tokenizer_path=model_path, skip_tokenizer_init=True, tp_size=tp_size,
        base_gpu_id=base_gpu_id, mem_fraction_static=cfg.mem_fraction_static,
        enable_memory_saver=cfg.enable_memory_saver, load_format=cfg.load_format, dtype=cfg.dtype,
        port=cfg.base_port + 16 * port_offset, nccl_port=cfg.base_port + 16 * port_offset + 8,
        random_seed=seed, log_level="error", disable_cuda_graph=not cfg.cuda_graph)
    if cfg.context_length:
        kwargs["context_length"] = cfg.context_length
    if routed_experts:
        kwargs["enable_return_routed_experts"] = True
    if cfg.deterministic_inference:
        kwargs["enable_deterministic_inference"] = True
    kwargs.update(cfg.engine_args)
    return kwargs
