"""Build a megatron-core `GPTModel` (this rank's pipeline stage and TP shard) from a `ModelSpec`.

Local (pure-torch) layer spec: RMSNorm, SwiGLU, RoPE with the model's base, grouped-query
attention, optional qkv bias, optional per-head q/k RMSNorm (Qwen3's, Megatron's qk_layernorm),
tied or untied embeddings. Every fusion is off so the same model runs on CPU and GPU; bf16/fp16
are for GPUs (CPU stays fp32).

Mixture of experts (Qwen3-MoE): each layer gets its own spec, dense or sparse as the model spec
says (`mlp_only_layers`, `decoder_sparse_step`); a sparse layer is Megatron's MoELayer with the
top-k router (softmax scores; `norm_topk_prob` picks softmax over the top-k logits, i.e. the
renormalised top-k probabilities, else the top-k of the softmax over all experts), the alltoall
token dispatcher and local experts run one after another (SequentialMLP: pure torch, any device),
split over `train.ep` expert-parallel ranks. Routing replay (`moe.RoutingReplay`) is installed on
every router.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from hybridrl.backends.megatron import upstream  # noqa: F401  (megatron-core imported first, there)
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnBackend

from hybridrl.backends.megatron.adapters import Slot, Split
from hybridrl.backends.model_spec import ModelSpec
from hybridrl.backends.megatron.attention import SDPAttention
from hybridrl.backends.megatron.config import MegatronConfig, pipeline_stage_layers
from hybridrl.backends.megatron.moe import moe_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_matrix_units(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` matrices natively (AVX512-BF16 / AMX for bfloat16, AVX512-FP16 / AMX
    for float16), as oneDNN, which runs torch's CPU matrix products in those dtypes, reports it."""
    if dtype is torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype is torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def transformer_config(spec: ModelSpec, cfg: MegatronConfig, *, device: torch.device) -> TransformerConfig:
    """Megatron's TransformerConfig for the model `spec` under the layout and precision of `cfg`."""
    stages = pipeline_stage_layers(spec.num_layers, cfg.pp)
    uneven = len(set(stages)) > 1
    dtype = DTYPES[cfg.dtype]
    if device.type == "cpu" and dtype is not torch.float32 and not cpu_has_matrix_units(dtype):
        raise ValueError(f"train.dtype={cfg.dtype} on this CPU: it has no {cfg.dtype} matrix instructions (oneDNN "
                         f"reports none), so {cfg.dtype} products run emulated, many times slower than float32: "
                         "use train.dtype=float32")
    return TransformerConfig(
        qk_layernorm=spec.qk_norm,
        **moe_config(spec, cfg),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        attention_backend=AttnBackend.local,
        # parallel layout
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        num_layers_in_first_pipeline_stage=stages[0] if uneven else None,
        num_layers_in_last_pipeline_stage=stages[-1] if uneven else None,
        sequence_parallel=False,
        variable_seq_lengths=cfg.pp > 1,           # each micro-batch is cut to its own longest sequence
        # precision
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        # weights come from the HF checkpoint: skip random init (see mark_tensor_parallel)
        use_cpu_initialization=device.type == "cpu",
        perform_initialization=False,
        # no fused kernels (CPU has none; on GPU the local spec does not use TE either)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        # CPU: each linear's weight gradient accumulates into main_grad inside its product (cpu_compat's
        # WgradAccumulation); a frozen weight (LoRA's base) takes Megatron's linear_with_frozen_weight, which
        # computes no weight gradient at all. GPU: needs Apex, which the image does not ship.
        gradient_accumulation_fusion=device.type == "cpu",
        # our loss_func returns globally normalised losses: no per-micro-batch / per-DP averaging
        calculate_per_token_loss=True,
        recompute_granularity="full" if cfg.recompute_activations else None,
        recompute_method="uniform" if cfg.recompute_activations else None,
        recompute_num_layers=1 if cfg.recompute_activations else None,
    )


def layer_spec(cfg: MegatronConfig, *, qk_norm: bool = False, num_experts: int | None = None):
    """Megatron's local (pure torch) layer spec with RMSNorm (a sparse MLP with `num_experts`
    experts); core attention per cfg.attention."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_norm, num_experts=num_experts,
                                    moe_grouped_gemm=False)
    if cfg.attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


def decoder_spec(spec: ModelSpec, cfg: MegatronConfig):
    """One layer spec for the whole model (dense), or this pipeline stage's per-layer specs (MoE)."""
    if not spec.is_moe:
        return layer_spec(cfg, qk_norm=spec.qk_norm)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    dense, sparse = layer_spec(cfg, qk_norm=spec.qk_norm), layer_spec(cfg, qk_norm=spec.qk_norm,
                                                                       num_experts=spec.num_experts)
    stages = pipeline_stage_layers(spec.num_layers, cfg.pp)
    stage = ps.get_pipeline_model_parallel_rank()
    first = sum(stages[:stage])
    layers = [sparse if spec.moe_index(i) is not None else dense for i in range(first, first + stages[stage])]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=dense.submodules.input_layernorm)


def build_gpt_model(spec: ModelSpec, cfg: MegatronConfig, config: TransformerConfig, *,
                    padded_vocab_size: int, device: torch.device) -> GPTModel:
    """This rank's stage of the model, parameters on `device` (values are loaded afterwards)."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(spec, cfg),
        vocab_size=padded_vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
    )
    # RoPE frequencies from the shared model spec (default, linear and llama3 scaling), so the
    # trainer rotates exactly as the rollout engines do; Megatron's own scaling knobs are not used.
    rotary = model.rotary_pos_emb
    rotary.inv_freq = spec.inv_freq().to(device=rotary.inv_freq.device, dtype=rotary.inv_freq.dtype)
    # The local spec's norms (torch.nn.RMSNorm through WrappedTorchNorm) are built without a dtype,
    # i.e. float32; every other parameter is in params_dtype. Cast them, so that a bf16 model is
    # bf16 throughout (published, exported and broadcast between stages as `hf_spec` says).
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            module.to(config.params_dtype)
    model = model.to(device)
    if spec.is_moe:
        from hybridrl.backends.megatron.moe import RoutingReplay

        RoutingReplay.install(model, spec, local_layers(model))
    return model


def mark_tensor_parallel(params: Mapping[Slot, torch.nn.Parameter]) -> None:
    """Tag TP-sharded parameters the way Megatron's initialisers would.

    With perform_initialization=False (we load weights instead of drawing them) megatron-core
    0.16 never sets `tensor_model_parallel` / `partition_dim` on linear and embedding weights
    (tensor_parallel/layers.py: only _initialize_affine_weight_{cpu,gpu} do), so the gradient
    norm would count only TP rank 0's shard. The adapter knows every slot's split."""
    for slot, param in params.items():
        if slot.split is not Split.NONE and not hasattr(param, "tensor_model_parallel"):  # biases have it
            set_tensor_model_parallel_attributes(param, True, 1 if slot.split is Split.ROW else 0, 1)


def local_layers(model: GPTModel) -> dict[int, torch.nn.Module]:
    """Global layer index (0-based) -> this stage's TransformerLayer."""
    return {layer.layer_number - 1: layer for layer in model.decoder.layers}
