"""The `vllm` knobs of the rollout section. Engine arguments we do not model pass through `engine_args`.

Import-light on purpose (no torch, no vllm): the config schema imports it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, knob

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")     # HF config keys of a MoE model
PLAIN_CPU_LOAD_FORMAT = "hybridrl_plain_cpu"      # the worker's CPU model loader (worker.PlainWeightsLoader)


@dataclass(kw_only=True)
class VLLMConfig:
    """vLLM's V1 engine (its engine core and worker run in processes of their own), one per rollout rank."""

    dtype: str = knob("auto", "weights and KV dtype: auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | "
                              "float16")
    kv_cache_mb: int = knob(0, "KV-cache budget in MiB (vLLM's kv_cache_memory_bytes), allocated at start; 0 = 64 "
                               "on CPU, and on CUDA vLLM's own sizing from gpu_memory_utilization (a fixed budget "
                               "there overrides it, and a context longer than it holds refuses to start)")
    max_num_seqs: int = knob(64, "most sequences in the running batch")
    max_num_batched_tokens: int = knob(0, "tokens computed per step; 0 = vLLM's default (on CPU at least the longest context: prompts are never prefilled in chunks there, as vLLM's CPU sampler cannot rewind a seeded request's generator)")
    max_model_len: int = knob(0, "longest sequence (prompt + output); 0 = the model's")
    enable_prefix_caching: bool = knob(True, "vLLM's prefix cache (reset whenever a new policy version arrives)")
    enforce_eager: bool = knob(False, "CUDA: no torch.compile / CUDA graphs (start-up in seconds, slower decoding; "
                                      "graphs are safe: publications copy in place). vLLM always runs eager on CPU "
                                      "here (compiling takes minutes)")
    threads: int = knob(0, "OpenMP threads of vLLM's worker process; 0 = this process's torch thread count (1 per "
                           "rank under torchrun, so two ranks on two cores share them sanely)")
    gpu_memory_utilization: float = knob(0.5, "CUDA only: fraction of the GPU for weights + KV cache (the trainer "
                                              "holds the rest)")
    enable_sleep_mode: bool = knob(False, "CUDA only: release weights and KV cache between modes through vLLM's "
                                          "sleep levels (vLLM refuses sleep mode on CPU)")
    log_level: str = knob("WARNING", "vLLM's own log level (VLLM_LOGGING_LEVEL) in its processes")
    engine_args: dict[str, Any] = knob(factory=dict, help="extra vllm AsyncEngineArgs(**kwargs), passed through "
                                                          "unchecked")

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_positive("kv_cache_mb", self.kv_cache_mb, allow_zero=True)
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens, allow_zero=True)
        check_positive("max_model_len", self.max_model_len, allow_zero=True)
        check_positive("threads", self.threads, allow_zero=True)
        check_choice("log_level", self.log_level, ("DEBUG", "INFO", "WARNING", "ERROR"))
        if not 0.0 < self.gpu_memory_utilization < 1.0:
            raise ConfigValueError("gpu_memory_utilization", f"must be in (0, 1), got {self.gpu_memory_utilization}")

    def releasable_tags(self, on_cuda: bool) -> frozenset[str]:
        """What the engine releases between modes: on CUDA with sleep mode, weights (sleep level 2: they must be
        published again) and the KV cache; on CPU nothing (vLLM has no sleep mode there: the KV cache stays
        allocated and the weights stay where they are)."""
        if on_cuda and self.enable_sleep_mode:
            return frozenset({"weights", "kv_cache"})
        return frozenset()


def model_problem(hf_config: dict[str, Any], model_dir: str | Path = "") -> str | None:
    """Why this backend cannot serve the model, or None. Mixture-of-experts models are refused: vLLM keeps
    a layer's experts fused in one [experts, ...] parameter (FusedMoE `w13_weight` / `w2_weight`, vllm 0.32
    model_executor/layers/fused_moe/unquantized_fused_moe_method.py:87-96, replaced after loading at :188),
    where the worker's map of whole or row-packed parameters places no expert, so a publication could not
    be read back; and routing replay would need vLLM's routing records (`enable_return_routed_experts`,
    `CompletionOutput.routed_experts`, vllm/outputs.py:84), which this backend does not request."""
    experts = max((int(hf_config.get(k) or 0) for k in EXPERT_KEYS), default=0)
    if experts <= 0:
        return None
    where = f" {model_dir}" if model_dir else ""
    return (f"rollout.engine=vllm cannot serve the mixture-of-experts model{where} ({experts} experts): its "
            "publication has no map for vLLM's fused expert parameters and it returns no routing records for "
            "routing replay; use rollout.engine=sglang (GPU) or rollout.engine=native")


def model_dir_problem(model_dir: str | Path) -> str | None:
    """`model_problem` of an HF directory (its config.json; None when there is none to read)."""
    path = Path(model_dir) / "config.json"
    try:
        return model_problem(json.loads(path.read_text()), model_dir)
    except (OSError, ValueError):
        return None
