"""cpu_compat.multi_tensor_scale gives the values of megatron-core's local stand-in for Apex's
multi_tensor_scale (`dst.copy_(src * scale)`) without its temporary per tensor, and replaces it where
megatron's clipping and mixed-precision copies use it once the CPU patches are active."""

from __future__ import annotations

import torch

from hybridrl.backends.megatron import cpu_compat, upstream  # noqa: F401  (megatron-core imported first)


def _pairs(gen):
    return [torch.randn(33, 7, generator=gen), torch.randn(5, generator=gen).bfloat16(), torch.randn(64, generator=gen)]


def test_the_same_values_as_megatrons_local_scale():
    from megatron.core.utils import local_multi_tensor_scale

    for scale in (0.37, 1.0, 2.5):
        src = _pairs(torch.Generator().manual_seed(0))
        ours_in_place, theirs_in_place = [t.clone() for t in src], [t.clone() for t in src]
        cpu_compat.multi_tensor_scale(0, None, [ours_in_place, ours_in_place], scale)       # clipping: src is dst
        local_multi_tensor_scale(0, None, [theirs_in_place, theirs_in_place], scale)
        assert all(torch.equal(a, b) for a, b in zip(ours_in_place, theirs_in_place))
        ours, theirs = [torch.empty_like(t) for t in src], [torch.empty_like(t) for t in src]
        cpu_compat.multi_tensor_scale(0, None, [src, ours], scale)
        local_multi_tensor_scale(0, None, [src, theirs], scale)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        fp32 = [t.float() for t in src]                                 # master weights -> bfloat16 parameters
        ours, theirs = [torch.empty_like(t, dtype=torch.bfloat16) for t in src], [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        cpu_compat.multi_tensor_scale(0, None, [fp32, ours], scale)
        local_multi_tensor_scale(0, None, [fp32, theirs], scale)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_active_cpu_patches_put_it_where_megatron_scales():
    from megatron.core.optimizer import clip_grads, optimizer

    cpu_compat.activate()
    assert clip_grads.multi_tensor_scale_impl is cpu_compat.multi_tensor_scale
    assert optimizer.multi_tensor_scale_impl is cpu_compat.multi_tensor_scale
    grads = [torch.ones(10), torch.full((3,), 2.0)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    with cpu_compat.device_scope(torch.device("cpu")):                                  # its grad.type() check
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=4.0)      # clip_coeff ~ 0.25
    assert torch.allclose(grads[0], torch.full((10,), 0.25), rtol=1e-5) and grads[1].data_ptr() == params[1].grad.data_ptr()
