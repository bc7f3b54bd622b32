"""`SGLangEngine`: the RolloutEngine protocol over an in-process `sglang.Engine` (GPU extra).

Written against sglang 0.5.x from its source (it cannot run where hybridrl is developed):
generation through `async_generate(input_ids=..., return_logprob=True, rid=...)`; memory through
the tokenizer manager's `release_memory_occupation` / `resume_memory_occupation` with tags
"weights" and "kv_cache" (the Engine's own sync wrappers call run_until_complete and cannot be
used inside our event loop); weights through `update_weights_from_tensor` with one serialized
payload per TP rank and `flush_cache` once the whole publication has arrived.

Lifecycle in the hybrid worker: start with dummy weights; per rollout: resume weights -> push
every tensor (version bumps when all arrived) -> resume KV cache -> generate -> release all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from hybridrl.backends.sglang import convert
from hybridrl.backends.sglang.config import SGLangConfig
from hybridrl.publication.manifest import PublicationError, check_specs
from hybridrl.publication.transport_cuda_ipc import CudaIpcTransport
from hybridrl.rollout.protocol import GenerationOutput, GenerationTimings, SamplingParams, validate_named_tensors
from hybridrl.rollout.versions import Publication

log = logging.getLogger(__name__)

_TAGS = ("weights", "kv_cache")


def checkpoint_spec(model_dir: str | Path, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """HF tensor names and shapes from the safetensors headers (no data read), in the engine dtype."""
    from safetensors import safe_open

    spec = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                spec[name] = (tuple(f.get_slice(name).get_shape()), dtype)
    if not spec:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return spec


class SGLangEngine:
    def __init__(self, model_path: str, cfg: SGLangConfig, *, tp_size: int = 1, base_gpu_id: int = 0,
                 port_offset: int = 0, seed: int = 0, max_model_len: int | None = None):
        import sglang

        self.cfg = cfg
        self.tp_size = tp_size
        self.dtype = getattr(torch, cfg.dtype)
        kwargs: dict[str, Any] = dict(
            model_path=model_path, tokenizer_path=model_path, skip_tokenizer_init=True, tp_size=tp_size,
            base_gpu_id=base_gpu_id, mem_fraction_static=cfg.mem_fraction_static,
            enable_memory_saver=cfg.enable_memory_saver, load_format=cfg.load_format, dtype=cfg.dtype,
            port=cfg.base_port + 16 * port_offset, nccl_port=cfg.base_port + 16 * port_offset + 8,
            random_seed=seed, log_level="error", disable_cuda_graph=not cfg.cuda_graph)
        if cfg.context_length:
            kwargs["context_length"] = cfg.context_length
        kwargs.update(cfg.engine_args)
        self._engine = sglang.Engine(**kwargs)
        self._tm = self._engine.tokenizer_manager
        self._spec = checkpoint_spec(model_path, self.dtype)
        self._publication = Publication(self._spec, -1 if cfg.load_format == "dummy" else 0)
        self._released: set[str] = set()
        self._in_flight: set[str] = set()
        self.eos_token_ids = tuple(self._eos_ids(model_path))
        self.max_model_len = max_model_len or int(self._engine.server_args.context_length or 0) or None
        self._transport = CudaIpcTransport(self, [0], None)   # single-rank group by default

    # ---------------------------------------------------------------- protocol

    @property
    def policy_version(self) -> int:
        return self._publication.version

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._spec)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> GenerationOutput:
        if self.policy_version < 0:
            raise RuntimeError("SGLang engine has no weights yet: publish a policy before generating")
        if "kv_cache" in self._released:
            raise RuntimeError("SGLang engine is asleep: call wake_up() before generating")
        version = self.policy_version
        started = time.perf_counter()
        self._in_flight.add(request_id)
        try:
            out = await self._engine.async_generate(
                input_ids=list(token_ids), sampling_params=convert.sampling_params(sampling, self.eos_token_ids),
                return_logprob=True, rid=request_id)
        finally:
            self._in_flight.discard(request_id)
        total = time.perf_counter() - started
        if self.policy_version != version:
            raise RuntimeError(f"request {request_id} spans a weight update (v{version} -> v{self.policy_version})")
        return convert.generation_output(out, request_id=request_id, policy_version=version,
                                         prompt_tokens=len(token_ids), max_new_tokens=sampling.max_new_tokens,
                                         timings=GenerationTimings(total_s=total))

    async def abort(self, request_id: str) -> bool:
        if request_id not in self._in_flight:
            return False
        self._tm.abort_request(rid=request_id)
        return True

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Validated whole against the checkpoint's names, shapes and the engine dtype before anything
        is sent (a bad call changes nothing), then pushed as one bucket over CUDA IPC."""
        items = list(named_tensors)
        validate_named_tensors(items, self._spec)
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version must be an int >= 0, got {version!r}")
        await self._transport.send(items, version)

    async def load_serialized(self, payloads: list[Any], names: list[str], version: int) -> None:
        """Load one bucket: `payloads[i]` is SGLang TP rank i's serialized list of (name, tensor)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        unknown = sorted(set(names) - set(self._spec))
        if unknown:
            raise PublicationError(f"unknown tensor(s) for this engine: {unknown[:5]}")
        if "weights" in self._released:
            raise RuntimeError("weights are released: call resume_weights() before pushing a publication")
        fields = {f.name for f in dataclasses.fields(UpdateWeightsFromTensorReqInput)}
        kwargs: dict[str, Any] = {"serialized_named_tensors": payloads, "load_format": None, "flush_cache": False}
        if "weight_version" in fields:
            kwargs["weight_version"] = str(version)
        result = await self._tm.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(**kwargs), None)
        success, message = (result[0], result[1]) if isinstance(result, tuple) else (result.success, result.message)
        if not success:
            raise PublicationError(f"SGLang refused bucket for v{version}: {message}")
        if self._publication.completes(names, version):
            await self._flush()        # before the version switches: no request sees stale KV
        self._publication.arrive(names, version)

    async def sleep(self) -> None:
        """Abort the requests in flight (they end with FinishReason.ABORT), then release the KV cache."""
        for rid in list(self._in_flight):
            self._tm.abort_request(rid=rid)
        for _ in range(200):
            if not self._in_flight:
                break
            await asyncio.sleep(0.05)
        await self._release(["kv_cache"])

    async def wake_up(self) -> None:
        await self._resume(["kv_cache"])

    async def release_weights(self) -> None:
        """Free the weights too (they are discarded: every tensor must be pushed again)."""
        await self._release(["weights"])
        self._publication.version = -1

    async def resume_weights(self) -> None:
        await self._resume(["weights"])

    def stats(self) -> dict[str, Any]:
        return {"policy_version": self.policy_version, "released": sorted(self._released),
                "requests_in_flight": len(self._in_flight), "tp_size": self.tp_size}

    def close(self) -> None:
        """Stop SGLang's scheduler and detokenizer processes (idempotent)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # ---------------------------------------------------------------- internals

    async def _release(self, tags: list[str]) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        tags = [t for t in tags if t not in self._released]
        if not tags:
            return
        if self._in_flight:
            raise RuntimeError(f"cannot release {tags} with {len(self._in_flight)} request(s) in flight")
        await self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), None)
        self._released.update(tags)

    async def _resume(self, tags: list[str]) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        tags = [t for t in tags if t in self._released]
        if tags:
            await self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None)
            self._released.difference_update(tags)

    async def _flush(self) -> None:
        for _ in range(100):
            result = await self._tm.flush_cache()
            if getattr(result, "success", True):
                return
            await asyncio.sleep(0.05)   # flush fails while requests are pending
        raise RuntimeError("SGLang flush_cache kept failing after a weight update")

    @staticmethod
    def _eos_ids(model_path: str) -> list[int]:
        import json

        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            path = Path(model_path) / name
            if path.exists():
                eos = json.loads(path.read_text()).get("eos_token_id")
                ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        return sorted(set(ids))


def check_publication(engine: SGLangEngine, published: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """Structure problems of a publication against the engine (empty when it fits)."""
    return check_specs(published.items(), engine.weight_spec())
