"""What a vLLM engine is started with: the checkpoint's files read without loading it, the engine's
arguments (`AsyncEngineArgs`) and the environment its processes start in, on CPU and on CUDA.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Mapping

import torch

from hybridrl.backends.vllm.config import PLAIN_CPU_LOAD_FORMAT, VLLMConfig

WORKER_EXTENSION = "hybridrl.backends.vllm.worker.WeightSync"
CPU_KV_CACHE_MB = 64        # rollout.vllm.kv_cache_mb=0 on CPU (vLLM has no memory profile to size it from there)


def checkpoint_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


@contextmanager
def process_env(values: dict[str, str]):
    """Environment variables the engine's processes read at start (spawned children inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kv_cache_bytes(cfg: VLLMConfig, on_cuda: bool) -> int | None:
    """vLLM's kv_cache_memory_bytes: `kv_cache_mb` when set; else 64 MiB on CPU and, on CUDA, None: vLLM then
    sizes the cache from `gpu_memory_utilization` (a fixed budget there overrides it, vllm 0.32
    v1/worker/gpu_worker.py:649-672, and a context longer than the budget holds refuses to start,
    v1/core/kv_cache_utils.py:1021-1040)."""
    if cfg.kv_cache_mb:
        return cfg.kv_cache_mb << 20
    return None if on_cuda else CPU_KV_CACHE_MB << 20


def engine_args(cfg: VLLMConfig, model_path: str, *, dtype: str, on_cuda: bool, seed: int) -> dict[str, Any]:
    """`AsyncEngineArgs(**kwargs)` for one engine (tensor parallel 1: one engine per rank).

    CPU: our plain-weights loader, never chunked prefill (see below), eager (compiling takes minutes).
    CUDA: `gpu_memory_utilization`, sleep mode when asked, CUDA graphs unless `enforce_eager`: a
    publication copies into the live parameters in place (the model's weight loaders write into the
    existing storage), so the addresses the graphs captured stay valid across versions; sleep level 2
    discards and re-allocates the weights through vLLM's own allocator, which keeps their addresses."""
    kwargs: dict[str, Any] = dict(
        model=model_path, dtype=dtype, seed=seed, enforce_eager=cfg.enforce_eager or not on_cuda,
        skip_tokenizer_init=True, generation_config="vllm", logprobs_mode="processed_logprobs",
        max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.enable_prefix_caching,
        worker_extension_cls=WORKER_EXTENSION, disable_log_stats=True, tensor_parallel_size=1)
    kv_bytes = kv_cache_bytes(cfg, on_cuda)
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    if cfg.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if on_cuda:
        kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.enable_sleep_mode)
    else:
        # Every request here is seeded (a generator of its own); a prompt prefilled in chunks has the
        # token sampled after a partial chunk thrown away, and vLLM then rewinds that generator's
        # offset, which a CPU generator does not have ("CPU Generator does not use offset": the
        # engine core dies). So on CPU prompts are never chunked: the step's token budget holds a
        # whole context, and a request that does not fit waits for the next step.
        longest = cfg.max_model_len or int(checkpoint_config(model_path).get("max_position_embeddings", 0))
        kwargs.update(load_format=PLAIN_CPU_LOAD_FORMAT, enable_chunked_prefill=False,
                      max_num_batched_tokens=max(cfg.max_num_batched_tokens, longest, 2048))
    if cfg.max_model_len:
        kwargs["max_model_len"] = cfg.max_model_len
    kwargs.update(cfg.engine_args)
    return kwargs


def engine_env(cfg: VLLMConfig, *, on_cuda: bool, device_index: int | None,
               environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM's processes start with (spawned children inherit it; ours is put back after).

    CUDA: CUDA_VISIBLE_DEVICES names this rank's GPU alone (`ipc.visible_device`), so the engine core,
    which takes its first visible GPU, runs on the rank's and not on GPU 0 with every other engine of
    the node; spawn, as vLLM would force anyway once CUDA is initialised here
    (vllm/utils/system_utils.py `_maybe_force_spawn`). CPU: the worker's OpenMP threads, unbound."""
    from hybridrl.backends.vllm.ipc import visible_device

    environ = os.environ if environ is None else environ
    env = {"VLLM_LOGGING_LEVEL": cfg.log_level, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if on_cuda:
        if device_index is None:
            raise ValueError("a vLLM engine on CUDA needs the rank's device index")
        env.update(CUDA_VISIBLE_DEVICES=visible_device(device_index, environ), VLLM_WORKER_MULTIPROC_METHOD="spawn")
    else:
        threads = cfg.threads or torch.get_num_threads()
        env.update(VLLM_CPU_OMP_THREADS_BIND=environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                   OMP_NUM_THREADS=str(threads))
    return env


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
