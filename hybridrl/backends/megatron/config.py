"""`MegatronConfig`: the training backend's knobs (config section `train`). Import-light."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.backends.lora_names import PROJECTIONS as LORA_PROJECTIONS   # what a LoRA adapter can target
from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, knob, section

# The modes of hybridrl.algo.aggregation.AGGREGATIONS (that module imports torch; a test keeps
# the two equal).
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LR_SCHEDULES = ("constant", "linear", "cosine", "inverse-square-root")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters on the actor (config section `train.lora`); rank 0 trains the full model."""

    rank: int = knob(0, "LoRA rank r of every adapter; 0 = off (full fine-tuning)")
    alpha: float = knob(16.0, "LoRA scale numerator: the delta is (alpha / rank) * B A x")
    dropout: float = knob(0.0, "dropout on the adapters' input while training")
    target_modules: list[str] = knob(factory=lambda: list(LORA_PROJECTIONS),
                                     help="HF projections that get adapters (of q_proj k_proj v_proj o_proj gate_proj "
                                          "up_proj down_proj); empty = all seven")

    def __post_init__(self) -> None:
        check_positive("rank", self.rank, allow_zero=True)
        check_positive("alpha", self.alpha)
        check_range("dropout", self.dropout, 0.0, 0.999)
        if not self.target_modules:
            self.target_modules = list(LORA_PROJECTIONS)
        unknown = [m for m in self.target_modules if m not in LORA_PROJECTIONS]
        if unknown:
            raise ConfigValueError("target_modules", f"unknown projection(s) {unknown}: use HF names among "
                                   f"{list(LORA_PROJECTIONS)}")
        self.target_modules = [m for m in LORA_PROJECTIONS if m in self.target_modules]   # canonical order

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(kw_only=True)
class MegatronConfig:
    """Megatron-core actor/reference training: parallel layout, optimizer, schedule, loss reduction."""

    engine: str = knob("megatron", "the training engine (hybridrl.training.registry); this section holds its knobs")
    tp: int = knob(1, "tensor-parallel size (must divide the attention heads, KV heads and FFN size)")
    pp: int = knob(1, "pipeline-parallel size (at most the number of layers; when it does not divide them the "
                      "first and last stages take the remainder); dp = world / (tp * pp)")
    ep: int = knob(1, "expert-parallel size (mixture-of-experts models): each sparse layer's experts are split over "
                      "ep ranks of the data-parallel group (must divide dp and the number of experts)")
    moe_aux_loss_coef: float = knob(0.0, "load-balancing (Switch) auxiliary loss coefficient of the routers, per "
                                         "sparse layer; 0 = off (always logged as moe/aux_loss). Qwen3-MoE was "
                                         "pretrained with 0.001 (config.json router_aux_loss_coef)")
    moe_z_loss_coef: float = knob(0.0, "router z-loss coefficient (ST-MoE); 0 = off (Qwen3-MoE does not use one)")
    micro_batch_size: int = knob(4, "sequences per micro-batch (per data-parallel rank), each padded to its longest; "
                                    "unused when max_tokens_per_micro_batch > 0")
    max_tokens_per_micro_batch: int = knob(0, "pack sequences into micro-batches of at most this many real tokens "
                                              "(no padding computed; attention stays within each sequence); "
                                              "0 = off (micro_batch_size padded rows)")
    share_prefix: bool = knob(False, "in packs, rows that begin with the same tokens (the samples of one prompt) "
                                     "share them: the common prefix is laid out and computed once and every "
                                     "row's own tokens attend to it (same logprobs and gradients up to float "
                                     "rounding, fewer tokens through the model); needs max_tokens_per_micro_batch "
                                     "> 0; not for mixture-of-experts models")
    logprob_chunk_tokens: int = knob(0, "tokens per chunk of the logprob/entropy computation (float32 copies of the "
                                        "vocabulary-wide logits exist for one chunk at a time); 0 = ~64 MiB per copy")
    dtype: str = knob("float32", "parameter/compute dtype: float32 | bfloat16 | float16 (the reduced ones with float32 master weights and gradients in the optimizer; on a CPU only where it multiplies them natively: AVX512-BF16 or AMX for bfloat16, AVX512-FP16 or AMX for float16, refused elsewhere)")
    lr: float = knob(1e-6, "peak learning rate")
    min_lr: float = knob(0.0, "final learning rate of the decay")
    lr_warmup_steps: int = knob(0, "linear warm-up steps from 0 to lr")
    lr_decay_steps: int = knob(0, "optimizer step at which the decay reaches min_lr, warm-up included (unused if constant)")
    lr_schedule: str = knob("constant", f"after warm-up: one of {list(LR_SCHEDULES)}")
    weight_decay: float = knob(0.01, "decoupled (AdamW) weight decay; biases and norm scales are exempt")
    adam_beta1: float = knob(0.9, "Adam beta1")
    adam_beta2: float = knob(0.999, "Adam beta2")
    adam_eps: float = knob(1e-8, "Adam epsilon")
    clip_grad: float = knob(1.0, "clip gradients to this global L2 norm (0 = no clipping)")
    use_distributed_optimizer: bool = knob(True, "shard optimizer state over data-parallel ranks (ZeRO-1)")
    loss_aggregation: str = knob("token-mean", f"loss reduction, one of {list(AGGREGATIONS)}")
    attention: str = knob("sdpa", "core attention: sdpa (torch fused kernels) | megatron (its local DotProductAttention)")
    recompute_activations: bool = knob(False, "recompute each layer's activations in backward (saves memory)")
    make_vocab_size_divisible_by: int = knob(128, "pad the vocabulary to a multiple of this times tp")
    seed: int = knob(1234, "seed of Megatron's RNG trackers (dropout); weights come from the HF checkpoint")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters on the actor (rank 0 = off): the base is frozen and "
                                           "serves as the reference model")

    def __post_init__(self) -> None:
        from hybridrl.training.registry import ENGINES

        ENGINES.check("engine", self.engine)
        for name in ("tp", "pp", "ep", "micro_batch_size", "make_vocab_size_divisible_by"):
            check_positive(name, getattr(self, name))
        check_positive("moe_aux_loss_coef", self.moe_aux_loss_coef, allow_zero=True)
        check_positive("moe_z_loss_coef", self.moe_z_loss_coef, allow_zero=True)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("attention", self.attention, ("sdpa", "megatron"))
        check_positive("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, allow_zero=True)
        check_positive("logprob_chunk_tokens", self.logprob_chunk_tokens, allow_zero=True)
        if self.share_prefix and not self.max_tokens_per_micro_batch:
            raise ConfigValueError("share_prefix", "shared prefixes are laid out in packs: set "
                                   "max_tokens_per_micro_batch > 0 too (e.g. 2048), or share_prefix=false")
        if self.max_tokens_per_micro_batch and self.attention != "sdpa":
            raise ConfigValueError("max_tokens_per_micro_batch", "packing needs attention=sdpa (Megatron's local "
                                   f"attention cannot isolate packed sequences), got attention={self.attention!r}")
        check_positive("lr", self.lr, allow_zero=True)
        check_positive("min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ConfigValueError("min_lr", f"must be <= lr ({self.lr}), got {self.min_lr}")
        check_positive("lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        check_positive("lr_decay_steps", self.lr_decay_steps, allow_zero=True)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.lr_schedule != "constant" and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ConfigValueError("lr_decay_steps", f"must exceed lr_warmup_steps ({self.lr_warmup_steps}) with "
                                   f"lr_schedule={self.lr_schedule!r}, got {self.lr_decay_steps}")
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_range("adam_beta1", self.adam_beta1, 0.0, 0.999999)
        check_range("adam_beta2", self.adam_beta2, 0.0, 0.999999)
        check_positive("adam_eps", self.adam_eps)
        check_positive("clip_grad", self.clip_grad, allow_zero=True)
        check_choice("loss_aggregation", self.loss_aggregation, AGGREGATIONS)

    def dp_size(self, world_size: int) -> int:
        """The data-parallel size for `world_size` ranks (raises when tp * pp does not divide it)."""
        if world_size % (self.tp * self.pp):
            raise ValueError(f"world size {world_size} is not divisible by tp*pp = {self.tp}*{self.pp}")
        dp = world_size // (self.tp * self.pp)
        if dp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the data-parallel size {dp} (world {world_size} / "
                             f"(tp {self.tp} * pp {self.pp}))")
        return dp


def pipeline_stage_layers(num_layers: int, pp: int) -> list[int]:
    """Transformer layers per pipeline stage. Even when pp divides num_layers; otherwise the middle
    stages get equal counts and the first and last stages the rest (the first one more when it is
    odd: the last stage also computes the logits), as Megatron's
    num_layers_in_{first,last}_pipeline_stage express it. 28 layers on 3 stages: [10, 9, 9]."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp={pp} must be between 1 and the number of layers ({num_layers})")
    q, r = divmod(num_layers, pp)
    if r == 0:
        return [q] * pp
    middle = q + 1 if r > 2 and num_layers - (pp - 2) * (q + 1) >= 2 else q
    rest = num_layers - (pp - 2) * middle
    first = (rest + 1) // 2
    return [first] + [middle] * (pp - 2) + [rest - first]


def layout_problem(*, tp: int, pp: int, num_layers: int, num_heads: int, num_kv_heads: int,
                   intermediate_size: int | None = None, world_size: int | None = None,
                   keys: tuple[str, str] = ("train.tp", "train.pp"), world_key: str = "world size",
                   ep: int = 1, num_experts: int = 0, moe_intermediate_size: int | None = None,
                   ep_key: str = "train.ep", training: bool = True) -> str | None:
    """The first reason the (tp, pp, ep) layout cannot run this model on `world_size` ranks, as one
    line naming the key; None when it can."""
    tp_key, pp_key = keys
    for key, value in ((tp_key, tp), (pp_key, pp), (ep_key, ep)):
        if value < 1:
            return f"{key}={value}: must be >= 1"
    if ep > 1 and not num_experts:
        return f"{ep_key}={ep}: expert parallelism needs a mixture-of-experts model (this one is dense)"
    if num_experts and num_experts % ep:
        return f"{ep_key}={ep}: does not divide the model's {num_experts} experts"
    if num_experts and moe_intermediate_size is not None and moe_intermediate_size % tp:
        return f"{tp_key}={tp}: does not divide the experts' FFN size {moe_intermediate_size}"
    if num_experts and tp > 1 and training:
        return (f"{tp_key}={tp} with a mixture-of-experts model: megatron-core trains MoE with tensor parallelism "
                f"only with sequence parallelism, which its local (pure torch) layers lack; use {ep_key} (and "
                f"{pp_key}) to split the model instead")
    if pp > num_layers:
        return f"{pp_key}={pp}: more pipeline stages than the model's {num_layers} layers (use {pp_key} <= {num_layers})"
    for what, n in (("attention heads", num_heads), ("KV heads", num_kv_heads), ("FFN size", intermediate_size)):
        if n is not None and n % tp:
            return (f"{tp_key}={tp}: does not divide the model's {n} {what} (tensor parallelism splits them "
                    f"evenly; use a divisor of {n})")
    if world_size is not None and world_size % (tp * pp):
        return (f"{tp_key}={tp} x {pp_key}={pp} = {tp * pp} does not divide the {world_key} {world_size} "
                f"(data parallelism takes world / (tp * pp) ranks)")
    if world_size is not None and (world_size // (tp * pp)) % ep:
        return (f"{ep_key}={ep}: does not divide the data-parallel size {world_size // (tp * pp)} (experts are "
                f"split over ranks of the data-parallel group)")
    return None
