"""`VLLMEngine`: the RolloutEngine protocol over vLLM's V1 `AsyncLLM` (separate venv: `make vllm-venv`).

Processes: vLLM runs its engine core and its worker in processes of their own (on CPU it always
does: its platform forces the multiprocess executor), started with `spawn`, so the program that
builds an engine must keep its entry under `if __name__ == "__main__":` (`python -m hybridrl.train`
does). The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) is not used: inside a rank,
torch.distributed is already initialised for the run's world, and vLLM would take that world as
its own (its group creation is collective over every rank, including those that run no engine).
Its own world of one lives in its worker process instead. vLLM ends those processes at shutdown; so
that a rank killed outright (SIGKILL, an out-of-memory kill) leaves none of them behind either, a
`distributed.reaper.Reaper` watches them and kills them once this process is gone. The worker's
OpenMP threads are `rollout.vllm.threads` (default: this process's torch threads, 1 per rank under
torchrun), unbound.

Threads: the AsyncLLM lives on an event loop in a thread of this engine's own, so the protocol's
coroutines work from any caller loop (the caller awaits a future of that loop) and its output
handler keeps reading while a rank's loop is stopped between calls.

Logprobs (sampler contract v1): vLLM runs with logprobs_mode="processed_logprobs" and returns the
sampled token's logprob of the distribution it sampled from: log_softmax(logits / T) (T = 1 for
greedy), the contract's quantity when no top-k / top-p filter is set. With a filter, vLLM's
processed logprobs are renormalised over the kept tokens and its raw logprobs ignore T; neither is
the contract's, so `generate` refuses top_k / top_p with temperature > 0. Seeds: vLLM gives every
seeded request a torch.Generator of its own (its CPU sampler draws that request's Gumbel noise from
it), so a seeded request reproduces whatever shares its batch; a request without one gets
seed = hash(engine seed, request id), as on the native engine (vLLM's draws differ from the native
engine's: the same seed does not give the same tokens across engines).

Versions: a publication (`update_weights` or `load_bucket`, in buckets) first stops admitting
requests and waits until those in flight have finished on their version (drain), copies through the
worker extension (`worker.WeightSync`) and counts a tensor as arrived only once its read-back digest
matched; when the version is complete the prefix cache is reset, vLLM's own weight version label is
set (every output's token spans are checked against it) and requests are admitted again.

Memory tags: on CPU nothing is releasable (vLLM has no sleep mode there); on CUDA with
`enable_sleep_mode`, "weights" is sleep level 2 (discarded: published again before serving) and
"kv_cache" alone is vLLM's release_kv_cache_memory; wake_up maps the tags onto vLLM's. The CUDA paths
(sleep levels, IPC buckets) are written against vLLM's source and have not run on a GPU yet.

CUDA: each rank's engine processes see the rank's GPU alone (CUDA_VISIBLE_DEVICES, `launch.engine_env`), bucket
handles name the GPU by UUID (`ipc`), the KV cache is sized by vLLM from `gpu_memory_utilization` unless
`kv_cache_mb` is set, and CUDA graphs are on unless `enforce_eager` (`launch.engine_args`). Mixture-of-experts
models are refused (`config.model_problem`): the worker's read-back map has no place for fused experts.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from hybridrl.backends.vllm.config import VLLMConfig, model_problem
from hybridrl.backends.model_spec import checkpoint_shapes, eos_token_ids
from hybridrl.backends.vllm.launch import (checkpoint_config, device_index, engine_args, engine_env,
                                            kv_cache_bytes, process_env)
from hybridrl.backends.vllm.transport import bucket_wire, pack_bucket, raw_bytes
from hybridrl.distributed.reaper import Reaper, descendants
from hybridrl.rollout.protocol import (
    KV_CACHE,
    WEIGHTS,
    FinishReason,
    GenerationOutput,
    GenerationTimings,
    SamplingParams,
    check_tags,
)
from hybridrl.rollout.versions import Publication
from hybridrl.rollout.weight_spec import WeightMismatch, dtype_name, validate_named_tensors

log = logging.getLogger(__name__)

MISSING_VLLM = ("rollout.engine=vllm needs vLLM, which lives in a venv of its own (its transformers range differs "
                "from the main venv's): run `make vllm-venv` and use .venv-vllm/bin/hybridrl")


def request_seed(engine_seed: int, request_id: str) -> int:
    """The seed of a request that brings none (63 bits: a torch.Generator seed)."""
    digest = hashlib.blake2b(f"{engine_seed}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Request:
    __slots__ = ("request_id", "aborted", "submitted")

    def __init__(self, request_id: str):
        self.request_id, self.aborted, self.submitted = request_id, False, False


class VLLMEngine:
    def __init__(self, model_path: str | Path, cfg: VLLMConfig | None = None, *, device: str | torch.device = "cpu",
                 seed: int = 0):
        cfg = cfg or VLLMConfig()
        self.cfg, self.seed = cfg, seed
        self.model_path = str(model_path)
        self.device = torch.device(device if str(device) != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        on_cuda = self.device.type == "cuda"
        if cfg.enable_sleep_mode and not on_cuda:
            raise ValueError("rollout.vllm.enable_sleep_mode: vLLM has no sleep mode on CPU ('Sleep mode is not "
                             "supported on current platform'); leave it false")
        self.releasable_tags = cfg.releasable_tags(on_cuda)
        self._kv_bytes = kv_cache_bytes(cfg, on_cuda)        # None on CUDA: vLLM's own sizing
        hf = checkpoint_config(self.model_path)
        problem = model_problem(hf, self.model_path)
        if problem:
            raise ValueError(problem)
        self.vocab_size = int(hf["vocab_size"])
        self.eos_token_ids = tuple(sorted(eos_token_ids(self.model_path)))
        dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hybridrl-vllm", daemon=True)
        self._thread.start()
        self._llm, self._reaper = None, None
        try:
            before = set(descendants())
            self._llm = self._start(dtype, on_cuda)
            # vLLM ends its processes at shutdown; a rank killed outright shuts nothing down
            self._reaper = Reaper([p for p in descendants() if p not in before])
            self.max_model_len = int(self._llm.model_config.max_model_len)
            tied = bool(hf.get("tie_word_embeddings", False))
            layout = self._rpc("hybridrl_layout", list(checkpoint_shapes(self.model_path)), tied)
        except BaseException:
            self.close()
            raise
        self._spec = {n: (tuple(shape), getattr(torch, dt)) for n, (shape, dt) in layout.items()}
        self._publication = Publication(self._spec, 0)
        self._requests: dict[str, _Request] = {}
        self._admitting = asyncio.Event()        # closed while a publication is under way; engine loop only
        self._drained = asyncio.Event()          # set whenever no submitted request is in vLLM
        self._call(self._open_gates())
        self._released: set[str] = set()
        self.counters = {"requests": 0, "prefill_tokens": 0, "prefix_hit_tokens": 0, "decode_tokens": 0,
                         "aborted_requests": 0, "weight_loads": 0}

    def _start(self, dtype: str, on_cuda: bool):
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as err:
            raise ImportError(f"{MISSING_VLLM} ({err})") from err

        if not on_cuda:
            import hybridrl.backends.vllm.worker  # noqa: F401 - registers the CPU loader (PLAIN_CPU_LOAD_FORMAT)

        kwargs = engine_args(self.cfg, self.model_path, dtype=dtype, on_cuda=on_cuda, seed=self.seed)
        env = engine_env(self.cfg, on_cuda=on_cuda, device_index=device_index(self.device) if on_cuda else None)
        restore = torch.set_num_threads

        async def build():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        with process_env(env):
            try:
                return self._call(build())
            finally:
                torch.set_num_threads = restore     # vLLM's CPU worker swaps it for a no-op where it runs

    # ---------------------------------------------------------------- as a registered rollout engine

    serves_before_publication = True        # loaded from the model directory: it serves version 0

    @classmethod
    def for_rank(cls, cfg: Any, ctx: Any) -> "VLLMEngine":
        """This rank's engine: the model directory, `rollout.vllm`'s knobs, the rank's device."""
        return cls(cfg.model.path, cfg.rollout.vllm, device=ctx.device, seed=cfg.run.seed + ctx.rank)

    @classmethod
    def releasable_tags_for(cls, cfg: Any) -> frozenset[str]:
        device = str(cfg.distributed.device)
        on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        return cfg.rollout.vllm.releasable_tags(on_cuda)

    @classmethod
    def colocated_transport(cls, engine: Any, ranks: Sequence[int], group: Any) -> Any:
        """Each flat bucket to this rank's engine in one collective RPC (rollout.tp is 1 with vLLM)."""
        from hybridrl.backends.vllm.transport import BucketRpcTransport

        return BucketRpcTransport(engine)

    # ---------------------------------------------------------------- protocol

    @property
    def policy_version(self) -> int:
        return self._publication.version

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._spec)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> GenerationOutput:
        prompt = self._check_prompt(token_ids, request_id)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if not sampling.greedy and (sampling.top_k != -1 or sampling.top_p < 1.0):
            raise ValueError(f"request {request_id!r}: the vLLM backend refuses top_k={sampling.top_k} / "
                             f"top_p={sampling.top_p} with temperature {sampling.temperature}: vLLM's logprobs are "
                             "then renormalised over the kept tokens, not the sampler contract's full-vocabulary "
                             "log_softmax(logits / T); set agent.top_k=-1 and agent.top_p=1.0")
        if self._released & {KV_CACHE, WEIGHTS}:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() before generate()")
        if len(prompt) >= self.max_model_len:
            return GenerationOutput(request_id=request_id, token_ids=[], logprobs=[], finish_reason=FinishReason.CONTEXT,
                                    policy_version=self.policy_version, prompt_tokens=len(prompt))
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        return await self._on_engine_loop(self._generate(prompt, sampling, request_id))

    async def abort(self, request_id: str) -> bool:
        """End a request now (FinishReason.ABORT, with the tokens it has). False if unknown or finished."""
        return await self._on_engine_loop(self._abort([request_id])) > 0

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             digests: Mapping[str, str] | None = None) -> None:
        """Copy HF-named tensors into the live weights in place (see the module doc); validated whole first.
        CPU tensors travel as bytes; tensors on the GPU (a disaggregated rollout rank receives into one) are
        packed into one flat bucket there and travel as its CUDA IPC handle (`load_bucket`)."""
        items = list(named_tensors)
        validate_named_tensors(items, self._spec)
        names = [n for n, _ in items]
        self._check_update(version, names, digests)
        devices = {t.device for _, t in items}
        if len(devices) > 1:
            raise ValueError(f"update_weights: the tensors of one call are on one device, got "
                             f"{sorted(map(str, devices))}")
        if devices and next(iter(devices)).type != "cpu":
            await self.load_bucket(pack_bucket(items), version, digests=digests)
            return
        wire = [(n, list(t.shape), dtype_name(t.dtype), raw_bytes(t)) for n, t in items]
        await self._on_engine_loop(self._apply("hybridrl_load", (wire,), names, version, digests))

    async def load_bucket(self, bucket: Any, version: int, *, names: Sequence[str] | None = None,
                          digests: Mapping[str, str] | None = None) -> None:
        """One flat bucket (`publication.buckets.FlatBucket`) in one RPC: its buffer (bytes from the CPU, a
        CUDA IPC handle from the GPU, `bucket_wire`) and layout; `names` of it are loaded (all by default)."""
        names = list(names) if names is not None else list(bucket.views)
        validate_named_tensors(bucket.named(names), self._spec)
        self._check_update(version, names, digests)
        entries = [(e.name, list(e.shape), dtype_name(e.dtype), e.start, e.end) for e in bucket.plan.entries]
        encoding, buffer = bucket_wire(bucket.buffer)
        try:
            await self._on_engine_loop(self._apply("hybridrl_load_bucket", (encoding, buffer, entries, names), names,
                                                   version, digests))
        finally:
            if encoding == "cuda_ipc":
                torch.cuda.ipc_collect()      # the worker has dropped its view: free what IPC still holds

    async def sleep(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        """Abort the requests in flight (FinishReason.ABORT), then release the tagged memory (see the module doc;
        on CPU there is nothing to release: only the aborts happen)."""
        tags = [t for t in check_tags(self, tags) if t not in self._released]
        await self._on_engine_loop(self._sleep(tags))

    async def wake_up(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        tags = [t for t in check_tags(self, tags) if t in self._released]
        if tags:
            await self._on_engine_loop(self._llm.wake_up(tags))
            self._released.difference_update(tags)

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "policy_version": self.policy_version, "pending_version": self._publication.pending,
                "requests_in_flight": len(self._requests), "released": sorted(self._released),
                "kv_cache_bytes": self._kv_bytes, "max_model_len": self.max_model_len}

    def call_worker(self, method: Any, *args: Any) -> Any:
        """collective_rpc(method, args) on vLLM's worker (a method name of `worker.WeightSync` or of vLLM's
        worker, or a function called with the worker first: tests, diagnostics); its one answer."""
        return self._rpc(method, *args)

    def close(self) -> None:
        """Stop vLLM's processes and this engine's thread (idempotent)."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            try:
                self._call(_shutdown(llm))
            except Exception as err:  # noqa: BLE001 - closing goes on
                log.warning("vLLM engine shutdown: %r", err)
        if self._reaper is not None:
            self._reaper.close()                 # whatever the shutdown left running
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    shutdown = close

    # ---------------------------------------------------------------- on the engine's loop

    async def _open_gates(self) -> None:
        self._admitting.set()
        self._drained.set()
        await self._llm.update_weight_version("0")

    async def _generate(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> GenerationOutput:
        from vllm import SamplingParams as VSampling
        from vllm.sampling_params import RequestOutputKind

        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        request = self._requests[request_id] = _Request(request_id)
        submitted = time.perf_counter()
        tokens: list[int] = []
        logprobs: list[float] = []
        finish, first, cached = None, 0.0, 0
        try:
            while not self._admitting.is_set():      # checked again: a publication may have begun since
                await self._admitting.wait()
            queued = time.perf_counter() - submitted
            version = self.policy_version
            if request.aborted:
                return GenerationOutput(request_id=request_id, token_ids=[], logprobs=[],
                                        finish_reason=FinishReason.ABORT, policy_version=version,
                                        prompt_tokens=len(prompt))
            stops = [] if sampling.ignore_eos else list(self.eos_token_ids)
            params = VSampling(
                max_tokens=min(sampling.max_new_tokens, self.max_model_len - len(prompt)),
                temperature=sampling.temperature, top_k=0, top_p=1.0, ignore_eos=sampling.ignore_eos,
                stop_token_ids=sorted(set(stops) | set(sampling.stop_token_ids)), logprobs=0, detokenize=False,
                seed=sampling.seed if sampling.seed is not None else request_seed(self.seed, request_id),
                output_kind=RequestOutputKind.DELTA)
            request.submitted = True
            self._drained.clear()
            async for out in self._llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
                piece = out.outputs[0]
                if piece.token_ids and not tokens:
                    first = time.perf_counter() - submitted
                for token, entry in zip(piece.token_ids, piece.logprobs or []):
                    tokens.append(int(token))
                    logprobs.append(float(entry[token].logprob))
                cached = out.num_cached_tokens or cached
                if out.finished:
                    finish = piece.finish_reason
                    _check_spans(piece.weight_versions, version, request_id)
            if self.policy_version != version:
                raise RuntimeError(f"request {request_id} spans a weight update (v{version} -> v{self.policy_version})")
        finally:
            self._requests.pop(request_id, None)
            if not any(r.submitted for r in self._requests.values()):
                self._drained.set()
        if len(tokens) != len(logprobs):
            raise RuntimeError(f"request {request_id}: vLLM returned {len(tokens)} tokens but {len(logprobs)} logprobs")
        self.counters["requests"] += 1
        self.counters["prefill_tokens"] += len(prompt) - cached
        self.counters["prefix_hit_tokens"] += cached
        self.counters["decode_tokens"] += len(tokens)
        return GenerationOutput(request_id=request_id, token_ids=tokens, logprobs=logprobs,
                                finish_reason=self._finish(finish, len(prompt) + len(tokens), sampling, len(tokens)),
                                policy_version=version, prompt_tokens=len(prompt), cached_prompt_tokens=cached,
                                timings=GenerationTimings(queued_s=queued, first_token_s=first,
                                                          total_s=time.perf_counter() - submitted))

    def _finish(self, reason: str | None, total: int, sampling: SamplingParams, generated: int) -> FinishReason:
        if reason == "stop":
            return FinishReason.STOP
        if reason == "abort" or reason is None:
            self.counters["aborted_requests"] += 1
            return FinishReason.ABORT
        if generated < sampling.max_new_tokens and total >= self.max_model_len:
            return FinishReason.CONTEXT
        return FinishReason.LENGTH

    async def _abort(self, request_ids: Sequence[str]) -> int:
        found = [self._requests[r] for r in request_ids if r in self._requests]
        for request in found:
            request.aborted = True
        submitted = [r.request_id for r in found if r.submitted]
        if submitted:
            await self._llm.abort(submitted)
        return len(found)

    async def _apply(self, method: str, args: tuple, names: list[str], version: int,
                     digests: Mapping[str, str] | None) -> None:
        """Drain, load one call through the worker (`method(*args, verify)`), count the verified tensors, open
        the gates when the version is complete."""
        self._admitting.clear()
        await self._drained.wait()
        self._publication.check(version)
        got = (await self._llm.collective_rpc(method, args=(*args, digests is not None)))[0]
        self.counters["weight_loads"] += 1
        bad = [] if digests is None else [n for n in names if got.get(n) != digests[n]]
        arrived = [n for n in names if n not in bad]
        if self._publication.completes(arrived, version):
            await self._llm.reset_prefix_cache()       # no cached KV of the old weights outlives them
            await self._llm.update_weight_version(str(version))
        if self._publication.arrive(arrived, version):
            self._admitting.set()
        if bad:
            raise WeightMismatch(bad, f"{len(bad)} tensor(s) read back from vLLM's storage differ from what was sent "
                                      f"for v{version}: {bad[:5]}")

    async def _sleep(self, tags: list[str]) -> None:
        await self._abort(list(self._requests))
        await self._drained.wait()
        if not tags:
            return
        if WEIGHTS in tags:
            await self._llm.sleep(level=2)
            self._released.update({WEIGHTS, KV_CACHE})
            self._publication.forget()
        else:
            await self._llm.pause_generation(mode="abort")
            await self._llm.release_kv_cache_memory()
            self._released.add(KV_CACHE)

    # ---------------------------------------------------------------- caller side

    def _check_update(self, version: int, names: list[str], digests: Mapping[str, str] | None) -> None:
        if WEIGHTS in self._released:
            raise RuntimeError("the weights are released: wake_up(['weights']) before publishing")
        self._publication.check(version)
        if digests is not None and not set(names) <= set(digests):
            raise ValueError("update_weights: digests must cover every tensor of the call")

    def _check_prompt(self, token_ids: Sequence[int], request_id: str) -> list[int]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if self._llm is None:
            raise RuntimeError("the vLLM engine is closed")
        prompt = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else [int(t) for t in token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad = next((i for i, t in enumerate(prompt) if t < 0 or t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"request {request_id!r}: token id {prompt[bad]} at position {bad} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return prompt

    async def _on_engine_loop(self, coro) -> Any:
        """Await `coro` on the engine's loop from the caller's; cancelling the caller cancels it there."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _call(self, coro) -> Any:
        """Run `coro` on the engine's loop and wait for it (from any thread but that loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _rpc(self, method: Any, *args: Any) -> Any:
        return self._call(self._llm.collective_rpc(method, args=args))[0]




def _check_spans(spans: Any, version: int, request_id: str) -> None:
    """vLLM's own record of the weights every output token came from must be this request's version alone."""
    labels = {span.version for span in spans or ()}
    if labels - {str(version)}:
        raise RuntimeError(f"request {request_id}: vLLM reports tokens from weight version(s) {sorted(labels)}, "
                           f"expected only v{version}")


async def _shutdown(llm: Any) -> None:
    llm.shutdown()
