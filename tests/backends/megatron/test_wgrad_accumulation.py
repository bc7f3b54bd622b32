"""The CPU stand-in for Apex's fused weight-gradient accumulation: a Megatron linear's weight gradient is
accumulated into `main_grad` inside its product, over micro-batches, with the values of the unfused path
(the whole train step against transformers is tests/backends/megatron/test_train_step.py, which runs with it)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.backends.megatron import cpu_compat


def _linear_backward_twice(dtype: torch.dtype, main_dtype: torch.dtype):
    """Two micro-batches through Megatron's linear with gradient_accumulation_fusion on, as its DDP
    prepares a parameter (main_grad, grad_added_to_main_grad)."""
    from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

    cpu_compat.activate()
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(24, 16, generator=gen).to(dtype))
    weight.main_grad = torch.zeros(24, 16, dtype=main_dtype)
    weight.grad_added_to_main_grad = False
    inputs = [torch.randn(5, 3, 16, generator=gen).to(dtype).requires_grad_() for _ in range(2)]
    grads = [torch.randn(5, 3, 24, generator=gen).to(dtype) for _ in range(2)]
    for x, g in zip(inputs, grads):
        out = linear_with_grad_accumulation_and_async_allreduce(
            x, weight, None, gradient_accumulation_fusion=True, allreduce_dgrad=False, sequence_parallel=False)
        out.backward(g)
    return weight, inputs, grads


def test_float32_weight_gradients_accumulate_into_main_grad_in_the_product():
    weight, inputs, grads = _linear_backward_twice(torch.float32, torch.float32)
    expected = sum(g.reshape(-1, 24).t() @ x.detach().reshape(-1, 16) for x, g in zip(inputs, grads))
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-6, atol=1e-6)
    assert weight.grad_added_to_main_grad          # the DDP hook then adds nothing more
    for x, g in zip(inputs, grads):                 # the input gradient is untouched by the fusion
        torch.testing.assert_close(x.grad, g @ weight.detach(), rtol=1e-6, atol=1e-6)


def test_bfloat16_products_are_rounded_once_then_added_as_unfused():
    weight, inputs, grads = _linear_backward_twice(torch.bfloat16, torch.float32)
    expected = torch.zeros(24, 16)
    for x, g in zip(inputs, grads):
        expected += (g.reshape(-1, 24).t() @ x.detach().reshape(-1, 16)).float()
    assert torch.equal(weight.main_grad, expected)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_cpu_training_fuses_and_a_frozen_base_computes_no_weight_gradient(lora_rank, tiny_models):
    from megatron.core.tensor_parallel import layers

    from hybridrl.backends.megatron.config import LoraConfig, MegatronConfig
    from hybridrl.backends.megatron.model import transformer_config
    from hybridrl.backends.model_spec import ModelSpec

    spec = ModelSpec.from_dir(tiny_models())
    cfg = MegatronConfig(lora=LoraConfig(rank=lora_rank))
    assert transformer_config(spec, cfg, device=torch.device("cpu")).gradient_accumulation_fusion
    # LoRA's frozen base weights never reach the fused path (which needs a main_grad): Megatron routes a
    # weight without requires_grad to linear_with_frozen_weight, input gradient only.
    frozen = torch.randn(6, 4)
    x = torch.randn(3, 4, requires_grad=True)
    out = layers.linear_with_frozen_weight(x, frozen, None, gradient_accumulation_fusion=True,
                                           allreduce_dgrad=False, sequence_parallel=False, tp_group=None)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(3, 6) @ frozen)
    assert frozen.grad is None
