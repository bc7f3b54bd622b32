"""The vllm rollout engine as a registered row (`rollout.registry.ENGINES`). Import-light: the config
checks read it; the engine loads when a rank builds it."""

from hybridrl.backends.vllm.config import VLLMConfig, model_dir_problem
from hybridrl.registry import Lazy
from hybridrl.rollout.registry import RolloutEngineSpec

_ENGINE = "hybridrl.backends.vllm.engine:VLLMEngine"

ENGINE = RolloutEngineSpec(
    "vllm", engine=Lazy(_ENGINE), config=VLLMConfig,
    colocated_transport=Lazy(f"{_ENGINE}.colocated_transport"),
    releasable_tags=Lazy(f"{_ENGINE}.releasable_tags_for"),
    serves_before_publication=True, reads_back_weights=True, remote_publication=True, loads_flat_buckets=True,
    model_problem=model_dir_problem,
    summary="CPU or GPU; its own venv: make vllm-venv",
    section_help="the vLLM engine: KV cache, batching, threads, sleep mode (CUDA)",
    single_rank=("the vLLM backend runs one engine per rollout rank (tensor-parallel size 1, so it can read "
                 "every published tensor back)"),
)
