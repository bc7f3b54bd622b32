"""`NativeEngineConfig`: the knobs of the native rollout engine (config section `rollout`).

Import-light on purpose (no torch): the config schema imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, knob

IN_FLIGHT_POLICIES = ("drain", "abort", "continue")
DRIVERS = ("auto", "loop", "thread")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNELS = ("auto", "c", "torch")
SHARING = ("copy", "share", "auto")


@dataclass(kw_only=True)
class NativeEngineConfig:
    """The native torch engine: paged KV cache, continuous batching, prefix reuse."""

    block_size: int = knob(16, "tokens per KV-cache block (the unit of paging and of prefix reuse)")
    kv_cache_mb: int = knob(256, "KV-cache budget in MiB, allocated (zeroed) at start and at wake_up; "
                                 "the number of blocks is derived from it")
    num_blocks: int = knob(0, "number of KV blocks; > 0 overrides kv_cache_mb")
    max_num_seqs: int = knob(64, "most sequences in the running batch (one decode token each per step)")
    max_num_batched_tokens: int = knob(
        512, "tokens computed per step (decodes + prefill chunks); longer prompts are prefilled in chunks")
    max_model_len: int = knob(0, "longest sequence (prompt + output); 0 = the model's max_position_embeddings, "
                                 "capped by what the KV cache holds")
    enable_prefix_caching: bool = knob(True, "reuse the KV blocks of shared prefixes (hash chains over full "
                                             "blocks, copy of the partial last block)")
    dtype: str = knob("auto", "weights and KV dtype: auto (float32 on CPU, bfloat16 on CUDA) | float32 | "
                              "bfloat16 | float16")
    seed: int = knob(0, "engine seed: requests without SamplingParams.seed get seed = hash(seed, request_id)")
    on_weight_update: str = knob(
        "drain", "requests in flight when new weights arrive: drain (they finish on the version they started "
                 "with, then the copy happens) | abort (they end now with finish_reason weights_updated) | "
                 "continue (no request waits: the buckets are staged beside the live weights and the whole "
                 "version is copied in between two engine steps; each running request keeps the tokens it has, "
                 "its prefix KV is recomputed under the new weights and its next tokens are a new segment of "
                 "the new version; costs one staged copy of the published tensors)")
    update_after_steps: int = knob(
        32, "on_weight_update=continue in the disaggregated placement: a publication is applied exactly this "
            "many engine steps after the rollout rank's last grant of groups (waiting there if the weights are "
            "late, or as soon as they are staged once no group runs), so which tokens each version samples "
            "does not depend on when the weights arrived; 0 = at the first step after they arrive "
            "(timing-dependent)")
    release_weights: bool = knob(
        False, "free the engine's copy of the weights while the trainer trains (colocated placement): the "
               "training phase holds the model's size less (the process's peak only where training holds it; "
               "on a CPU, where optimizer state stays through rollout, the rollout phase usually does), and "
               "every switch to rollout allocates it again and publishes every tensor into fresh pages (a "
               "slower switch: their first touch). Not with LoRA (a publication carries the adapters only) nor "
               "with the roles apart (a rollout rank never trains)")
    trainer_weights: str = knob(
        "copy", "colocated placement: how the engine holds what the trainer publishes. copy (its own copy of every "
                "tensor) | share (serve the trainer's own parameters in place wherever their layout is the engine's: "
                "at train.tp = pp = 1 every tensor, the fused q/k/v projections in Megatron's per-KV-group layout; "
                "no second copy of the model, and a publication hashes every tensor and copies none (but under "
                "publish.verify=post_copy, which compares a copy with what was sent); "
                "needs train.engine=megatron without LoRA, colocated, train.tp = pp = 1, one dtype on both sides, "
                "release_weights off and a CPU device, refused at load or on the device otherwise) | auto (share "
                "where it applies, copy elsewhere)")
    watermark_blocks: int = knob(1, "free blocks kept in reserve when admitting a request (fewer preemptions)")
    keep_kv_cache: bool = knob(
        False, "keep the KV cache allocated while the engine sleeps (a mode switch then neither frees nor re-zeroes "
               "it: on a CPU, where it is host memory, a wake costs nothing; the cache's contents are dropped all "
               "the same). Costs its kv_cache_mb during training")
    kernels: str = knob(
        "auto", "c (the engine's C kernels for the CPU in float32: decode attention read in place from the paged "
                "cache, RMSNorm, RoPE with the KV write, SiLU-and-multiply; built on first use with the machine's C "
                "compiler and cached) | torch (torch operators only: decodes gather their blocks for "
                "scaled_dot_product_attention) | auto (c where it applies and builds, else torch)")
    driver: str = knob(
        "auto", "where steps run: loop (a task on the caller's event loop, which regains control between "
                "steps) | thread (a dedicated thread: the loop never waits on a forward pass) | auto (loop on "
                "CPU, where OpenMP kernels launched from a second thread are slower; thread on CUDA)")
    speculative_tokens: int = knob(
        0, "exact speculative decoding by prompt lookup: up to this many tokens per decode step are drafted from "
           "an n-gram match in the sequence's own context (prompt + output) and verified by the model in the same "
           "forward; the sampled tokens and logprobs are those the engine draws without drafts. 0 = off")
    speculative_ngram_min: int = knob(2, "shortest suffix n-gram that prompt lookup matches (speculative_tokens > 0)")
    speculative_ngram_max: int = knob(4, "longest suffix n-gram that prompt lookup tries first (speculative_tokens > 0)")

    def __post_init__(self) -> None:
        check_positive("block_size", self.block_size)
        check_positive("kv_cache_mb", self.kv_cache_mb)
        check_positive("num_blocks", self.num_blocks, allow_zero=True)
        check_positive("max_num_seqs", self.max_num_seqs)
        check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        check_positive("max_model_len", self.max_model_len, allow_zero=True)
        check_positive("watermark_blocks", self.watermark_blocks, allow_zero=True)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("on_weight_update", self.on_weight_update, IN_FLIGHT_POLICIES)
        check_choice("driver", self.driver, DRIVERS)
        check_positive("update_after_steps", self.update_after_steps, allow_zero=True)
        check_choice("kernels", self.kernels, KERNELS)
        check_choice("trainer_weights", self.trainer_weights, SHARING)
        check_positive("speculative_tokens", self.speculative_tokens, allow_zero=True)
        check_positive("speculative_ngram_min", self.speculative_ngram_min)
        if self.speculative_ngram_max < self.speculative_ngram_min:
            raise ConfigValueError(
                "speculative_ngram_max", f"must be >= speculative_ngram_min ({self.speculative_ngram_min}), got "
                                         f"{self.speculative_ngram_max}: raise it or lower speculative_ngram_min")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigValueError(
                "max_num_batched_tokens",
                f"must be >= max_num_seqs ({self.max_num_seqs}) so that every running sequence can decode "
                f"each step, got {self.max_num_batched_tokens}")

    def releasable_tags(self) -> frozenset[str]:
        """What the engine releases between modes: its KV cache, and its weights with `release_weights`."""
        from hybridrl.rollout.protocol import KV_CACHE, WEIGHTS

        return frozenset({KV_CACHE, WEIGHTS}) if self.release_weights else frozenset({KV_CACHE})


def check_run(cfg: Any) -> None:
    """What `rollout.native` needs of the other sections."""
    problem = sharing_problem(cfg) if cfg.rollout.native.trainer_weights == "share" else None
    if problem is not None:
        raise ConfigValueError("rollout.native.trainer_weights", f"share: {problem}; or set it to auto or copy")
    if not cfg.rollout.native.release_weights:
        return
    if cfg.train.lora.rank > 0:
        raise ConfigValueError("rollout.native.release_weights", "a LoRA run publishes its adapters only, so the "
                                                                 "engine's base weights could not be made again after "
                                                                 "a release: set it to false, or train.lora.rank=0")
    if cfg.placement.resolve().split_roles:
        raise ConfigValueError("rollout.native.release_weights", f"with placement.mode={cfg.placement.mode} a "
                                                                 "rollout rank never trains, so there is no phase to "
                                                                 "release its weights in: set it to false")


def sharing_problem(cfg: Any) -> str | None:
    """Why the engines of this run cannot serve the trainer's parameters in place (None: they can)."""
    train, native = cfg.train, cfg.rollout.native
    if native.release_weights:
        return "the trainer's parameters cannot be released between modes: set rollout.native.release_weights=false"
    if train.engine != "megatron" or train.lora.rank > 0 or cfg.placement.resolve().split_roles:
        return ("it lends a Megatron trainer's parameters to the engine of the same process: it needs "
                "train.engine=megatron, train.lora.rank=0 and placement.mode=colocated")
    if train.tp != 1 or train.pp != 1 or native.dtype not in ("auto", train.dtype):
        return (f"the engine serves whole tensors in its own dtype: it needs train.tp=1, train.pp=1 and "
                f"rollout.native.dtype=auto or {train.dtype} (train.dtype), got tp={train.tp}, pp={train.pp}, "
                f"dtype={native.dtype}")
    return None


def shares_trainer_weights(cfg: Any) -> bool:
    """Whether this run's native engines serve the colocated trainer's parameters in place (`share`, or `auto`
    where the run allows it; the device is checked where the ranks know it)."""
    mode = cfg.rollout.native.trainer_weights
    return mode == "share" or (mode == "auto" and sharing_problem(cfg) is None)


def updates_in_flight(cfg: Any) -> bool:
    """Whether this run's native engines take a publication without draining (`on_weight_update=continue`)."""
    return cfg.rollout.engine_section.on_weight_update == "continue"
