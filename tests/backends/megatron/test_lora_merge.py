"""A LoRA publication's merge (base + scale * B A) runs where the weights are: the rank-r factors are
moved to the weights' device once per change of the adapters and multiplied there (`addmm_`), never
as a full-size product on the host. The meta device stands in for a GPU: any matrix product that runs
on the CPU while the weights are elsewhere is the host merge this replaces."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridrl.backends.megatron.lora import add_merged_, merge_fn

SCALE = 2.0


class CpuProducts(TorchDispatchMode):
    """Records every matrix product by the device it runs on."""

    def __init__(self):
        super().__init__()
        self.devices: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_,
                                   torch.ops.aten.matmul):
            self.devices.append(next(a.device.type for a in args if isinstance(a, torch.Tensor)))
        return func(*args, **(kwargs or {}))


def _engine(factors):
    return SimpleNamespace(lora=SimpleNamespace(merge_factors=None), _lora_full=factors,
                           cfg=SimpleNamespace(lora=SimpleNamespace(scale=SCALE)))


def _factors():
    g = torch.Generator().manual_seed(0)
    return {"model.layers.0.self_attn.q_proj": (torch.randn(4, 16, generator=g), torch.randn(32, 4, generator=g)),
            "model.layers.0.mlp.down_proj": (torch.randn(4, 24, generator=g), torch.randn(16, 4, generator=g))}


def test_the_merge_adds_scale_b_a_in_place_and_leaves_other_tensors():
    factors = _factors()
    engine = _engine(factors)
    out = {"model.layers.0.self_attn.q_proj.weight": torch.randn(32, 16), "model.layers.0.mlp.down_proj.weight":
           torch.randn(16, 24), "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 16)}
    before = {n: t.clone() for n, t in out.items()}
    add_merged_(engine, out, list(out))
    for module, (a, b) in factors.items():
        torch.testing.assert_close(out[f"{module}.weight"], before[f"{module}.weight"] + SCALE * b @ a)
    assert torch.equal(out["model.layers.0.self_attn.k_proj.weight"], before["model.layers.0.self_attn.k_proj.weight"])
    merge = merge_fn(engine)
    w = before["model.layers.0.mlp.down_proj.weight"]
    down = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(merge(down, w), out[down])
    assert merge("model.layers.0.self_attn.k_proj.weight", w) is w


def test_weights_on_another_device_are_merged_there_with_no_product_on_the_host():
    engine = _engine(_factors())
    out = {"model.layers.0.self_attn.q_proj.weight": torch.empty(32, 16, dtype=torch.bfloat16, device="meta"),
           "model.layers.0.mlp.down_proj.weight": torch.empty(16, 24, dtype=torch.bfloat16, device="meta")}
    with CpuProducts() as seen:
        add_merged_(engine, out, list(out))
        merge_fn(engine)("model.layers.0.mlp.down_proj.weight", out["model.layers.0.mlp.down_proj.weight"])
    assert seen.devices == ["meta"] * 3
    moved = engine.lora.merge_factors
    add_merged_(engine, out, list(out))
    assert engine.lora.merge_factors is moved                      # moved once until the adapters change
    engine._lora_full = _factors()
    add_merged_(engine, out, list(out))
    assert engine.lora.merge_factors is not moved
