"""Run megatron-core 0.16.x on CPU (gloo): every CUDA assumption on our path, covered in one place.

`activate()` is called by the engine only when its device is a CPU; on CUDA nothing here runs.
It makes process-wide patches of the `torch.cuda` entry points megatron calls unconditionally
(each listed with the upstream call sites it covers). `device_scope()` is a torch function mode
that maps `device="cuda"` literals, `.cuda()` and `param.type()` string checks to the CPU; the
engine enters it around its own work only, so other code in the process (e.g. a rollout engine)
pays nothing for it.

Upstream call sites (megatron/core/...), by patch:

torch.cuda.current_device -> "cpu"
    tensor_parallel/layers.py: VocabParallelEmbedding/ColumnParallelLinear/RowParallelLinear
    __init__ (weight allocation), linear_with_grad_accumulation_and_async_allreduce (buffers);
    tensor_parallel/mappings.py: _gather_along_first_dim, _reduce_scatter_along_first_dim;
    tensor_parallel/utils.py: split/gather helpers; transformer/dot_product_attention.py:
    DotProductAttention.forward (matmul_result buffer); pipeline_parallel/p2p_communication.py:
    _communicate_shapes, _communicate (receive buffers); distributed/param_and_grad_buffer.py:
    _ParamAndGradBuffer.__init__ (param/grad buffers); optimizer/distrib_optimizer.py
    (state gathers); optimizer/optimizer.py: MegatronOptimizer.get_loss_scale.
torch.cuda.Stream / current_stream / stream -> a stream that does nothing (CPU work is in order)
    transformer/moe/token_dispatcher.py: MoEAlltoAllTokenDispatcher.__init__ (its device-to-host
    stream) and _maybe_dtoh_and_synchronize (wait_stream, record_event, event.synchronize).
transformer/moe/token_dispatcher.py: maybe_move_tensor_to_cpu(as_numpy=True) -> numpy also for a CPU
    tensor (upstream converts only device tensors, and all_to_all_single then rejects the tensor
    split sizes of a CPU run).
optimizer/clip_grads.py and optimizer/optimizer.py: multi_tensor_scale_impl (megatron's local stand-in
    for Apex's) -> `multi_tensor_scale`, the same values without a temporary per tensor.
tensor_parallel/layers.py: fused_weight_gradient_mlp_cuda (Apex's CUDA extension, absent on a CPU) ->
    `WgradAccumulation`: LinearWithGradAccumulationAndAsyncCommunication.backward accumulates the weight
    gradient into `main_grad` inside the product (`addmm_`) when the config's gradient_accumulation_fusion
    is on (model.transformer_config turns it on for CPU training), instead of a parameter-sized gradient
    per micro-batch that the DDP hook then adds.
torch.cuda.synchronize -> no-op
    pipeline_parallel/p2p_communication.py: _communicate_shapes, _communicate;
    distributed/distributed_data_parallel.py: offload_grad_buffers / restore_grad_buffers;
    dist_checkpointing/strategies/{filesystem_async,fully_parallel,async_utils}.py.
torch.cuda.get_rng_state / manual_seed, tensor_parallel.random._get_cuda_rng_state /
_set_cuda_rng_state -> the CPU default generator
    tensor_parallel/random.py: CudaRNGStatesTracker.add / fork, model_parallel_cuda_manual_seed,
    _get_all_rng_states / _set_all_rng_states (activation recompute, checkpoint RNG state).
    (torch.cuda.manual_seed_all is left alone: torch.manual_seed calls it, redirecting recurses.)
device_scope(): device="cuda"/cuda:N/torch.device("cuda") -> cpu; Tensor.cuda() -> self;
Tensor.type() -> "torch.cuda.<T>Tensor"
    pipeline_parallel/schedules.py: forward_backward_no_pipelining /
    forward_backward_pipelining_without_interleaving (total_num_tokens);
    optimizer/optimizer.py: MixedPrecisionOptimizer.__init__ (found_inf, _scale_one),
    Float16OptimizerWithFloat16Params.__init__ and FP32Optimizer (param.type() checks, _scale);
    optimizer/distrib_optimizer.py: _build_model_and_main_param_groups (param.type() checks);
    optimizer/clip_grads.py: get_grad_norm_fp32, clip_grad_by_total_norm_fp32 (literals and
    grad.type() assert); optimizer/grad_scaler.py (literals); utils.py:
    local_multi_tensor_l2_norm (literal); distributed/param_and_grad_buffer.py:
    _ParamAndGradBuffer.__init__ (warm-up literal); dist_checkpointing/exchange_utils.py and
    strategies/state_dict_saver.py (literals, .cuda()).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_active = False


def activate() -> None:
    """Install the process-wide patches (idempotent). Call only when no CUDA device is used."""
    global _active
    with _lock:
        if _active:
            return
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer.moe import token_dispatcher

        torch.cuda.current_device = _current_device
        torch.cuda.synchronize = _synchronize
        torch.cuda.Stream = _CpuStream
        torch.cuda.current_stream = _current_stream
        torch.cuda.stream = _stream
        torch.cuda.get_rng_state = _get_rng_state
        torch.cuda.manual_seed = _manual_seed
        mrandom._get_cuda_rng_state = _get_cuda_rng_state
        mrandom._set_cuda_rng_state = _set_cuda_rng_state
        token_dispatcher.maybe_move_tensor_to_cpu = _to_host
        _scale_without_temporaries()
        _accumulate_wgrad_in_place()
        _active = True


def _scale_without_temporaries() -> None:
    """megatron-core's stand-in for Apex's `multi_tensor_scale` (utils.local_multi_tensor_scale, what
    optimizer/clip_grads.py and optimizer/optimizer.py use without Apex) writes `dst.copy_(src * scale)`: a
    parameter-sized temporary per tensor, also where it scales the gradients in place (clip_grads.py:
    clip_grad_by_total_norm_fp32, src is dst) and where it only copies (optimizer.py:
    _multi_tensor_copy_this_to_that, scale 1.0). `multi_tensor_scale` computes the same values without it."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = multi_tensor_scale


def _accumulate_wgrad_in_place() -> None:
    """Give megatron-core's linears a CPU `fused_weight_gradient_mlp_cuda` (see `WgradAccumulation`)."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = WgradAccumulation
    layers._grad_accum_fusion_available = True


class WgradAccumulation:
    """The two entry points of Apex's `fused_weight_gradient_mlp_cuda` on a CPU: `main_grad += grad_output^T @
    input` for a linear's 2-D input [tokens, in] and output gradient [tokens, out].

    Unfused, Megatron computes each micro-batch's weight gradient into a fresh parameter-sized tensor and the
    DDP hook adds it to the float32 `main_grad`: a second pass over every gradient per micro-batch. Here the
    product accumulates into `main_grad` (BLAS's beta = 1). Where the input's dtype is the gradient's, that is
    one `addmm_`; bfloat16 activations with float32 gradients (torch has no mixed-precision CPU `mm`) take the
    bfloat16 product, rounded once, and add it, the unfused path's values."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if total_input.dtype == main_grad.dtype:
            main_grad.addmm_(grad_output.t(), total_input)
        else:
            main_grad.add_(grad_output.t().mm(total_input))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def multi_tensor_scale(_chunk_size, _noop_flag, tensor_lists, scale) -> None:
    """`dst = src * scale` for each pair of tensor_lists[0], tensor_lists[1], the values of megatron-core's
    local_multi_tensor_scale: in place where src is dst, a plain copy at scale 1.0, written straight into dst
    where the dtypes agree."""
    for src, dst in zip(tensor_lists[0], tensor_lists[1]):
        if src is dst:
            dst.mul_(scale)
        elif scale == 1.0:
            dst.copy_(src)
        elif src.dtype == dst.dtype:
            torch.mul(src, scale, out=dst)
        else:
            dst.copy_(src * scale)


def _current_device() -> str:
    return "cpu"


def _synchronize(device=None) -> None:
    return None


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's maybe_move_tensor_to_cpu, with `as_numpy` honoured for tensors already on the CPU."""
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


class _CpuEvent:
    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


class _CpuStream:
    """Stands for a CUDA stream on the CPU, where work runs in program order."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


def _current_stream(device=None) -> _CpuStream:
    return _CPU_STREAM


def _stream(stream) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _get_rng_state(device="cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _get_cuda_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cuda_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


# ------------------------------------------------------------------------------------------------
# device literals


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_TENSOR_CUDA = {torch.Tensor.cuda}
_TENSOR_TYPE = {torch.Tensor.type}
_TENSOR_TO = {torch.Tensor.to}


class _CpuDeviceMode(TorchFunctionMode):
    """Maps CUDA device arguments to the CPU inside megatron code (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TENSOR_CUDA:
            return args[0]
        if func in _TENSOR_TYPE and len(args) == 1 and not kwargs:
            name = func(*args)                    # e.g. "torch.FloatTensor"
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func in _TENSOR_TO and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def device_scope(device: torch.device):
    """Inside megatron calls on `device`: on a CPU with the patches active, map CUDA literals."""
    if device.type != "cpu" or not _active:
        yield
        return
    with _CpuDeviceMode():
        yield


@contextlib.contextmanager
def native_ops():
    """Suspend `device_scope`'s mode around code without CUDA literals: the model's forward pass.

    The mode's Python dispatch costs every torch call a few microseconds (a large share of a small
    model's step on CPU). The backward pass does not pay it: `torch.autograd.backward` is intercepted once
    and runs with the mode popped."""
    mode = torch.overrides._get_current_function_mode()
    if not isinstance(mode, _CpuDeviceMode):
        yield
        return
    mode.__exit__(None, None, None)             # pops it (it is the innermost mode)
    try:
        yield
    finally:
        mode.__enter__()
