"""`MegatronConfig`: the training backend's knobs (config section `train`). Import-light."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, check_range, knob

# The modes of hybridrl.algo.aggregation.AGGREGATIONS (that module imports torch; a test keeps
# the two equal).
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LR_SCHEDULES = ("constant", "linear", "cosine", "inverse-square-root")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class MegatronConfig:
    """Megatron-core actor/reference training: parallel layout, optimizer, schedule, loss reduction."""

    tp: int = knob(1, "tensor-parallel size (must divide the number of KV heads)")
    pp: int = knob(1, "pipeline-parallel size (must divide the number of layers); dp = world / (tp * pp)")
    micro_batch_size: int = knob(4, "sequences per micro-batch (per data-parallel rank), each padded to its longest; "
                                    "unused when max_tokens_per_micro_batch > 0")
    max_tokens_per_micro_batch: int = knob(0, "pack sequences into micro-batches of at most this many real tokens "
                                              "(no padding computed; attention stays within each sequence); "
                                              "0 = off (micro_batch_size padded rows)")
    dtype: str = knob("float32", "parameter/compute dtype: float32 | bfloat16 | float16 (bf16/fp16 on GPUs)")
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

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "micro_batch_size", "make_vocab_size_divisible_by"):
            check_positive(name, getattr(self, name))
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("attention", self.attention, ("sdpa", "megatron"))
        check_positive("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, allow_zero=True)
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
        return world_size // (self.tp * self.pp)
