"""The torch Adam megatron-core builds on a machine without Transformer Engine or Apex runs torch's fused CPU
kernel (`step.fuse_cpu_adam`): the same update as torch's per-tensor loop to float32 rounding, on the groups of
float32 / bfloat16 CPU parameters only. (That a whole one-rank step still trains to the weights of plain
transformers + AdamW: tests/backends/megatron/test_train_step.py.)"""

from __future__ import annotations

import torch

from hybridrl.backends.megatron.step import fuse_cpu_adam


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype)) for shape in ((64, 32), (32,), (7,))]


def _steps(optimizer, params, steps=4):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        optimizer.step()


def test_the_fused_kernel_makes_the_loops_update():
    loop_params, fused_params = _params(), _params()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    loop, fused = torch.optim.AdamW(loop_params, **kw), torch.optim.AdamW(fused_params, **kw)
    assert fuse_cpu_adam(fused) == 1 and fused.param_groups[0]["fused"] and not fused.param_groups[0]["foreach"]
    assert not loop.param_groups[0]["fused"]
    _steps(loop, loop_params)
    _steps(fused, fused_params)
    for a, b, initial in zip(loop_params, fused_params, _params()):
        assert (a != initial).all()                                              # every element moved
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    for state_a, state_b in zip(loop.state.values(), fused.state.values()):
        torch.testing.assert_close(state_b["exp_avg_sq"], state_a["exp_avg_sq"], rtol=1e-6, atol=1e-12)


def test_only_groups_the_fused_kernel_takes_are_switched():
    optimizer = torch.optim.AdamW([{"params": _params(torch.float64)}, {"params": _params(torch.bfloat16)},
                                   {"params": []}], lr=1e-3)
    assert fuse_cpu_adam(optimizer) == 1                   # float64: the loop stays; an empty group: nothing to do
    assert [g["fused"] for g in optimizer.param_groups] == [None, True, None]
    foreign = torch.optim.AdamW(_params(), lr=1e-3)
    del foreign.param_groups[0]["fused"]                   # the groups of an optimizer without torch's fused switch
    assert fuse_cpu_adam(foreign) == 0 and "fused" not in foreign.param_groups[0]
    _steps(optimizer, [p for g in optimizer.param_groups for p in g["params"]], steps=2)      # both paths step
