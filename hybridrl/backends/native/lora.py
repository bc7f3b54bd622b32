"""LoRA adapters applied at run time by the native engine (a LoRA run publishes only these).

    y = W x + scale * B (A x)        scale = alpha / rank        (Hu et al. 2021, arXiv:2106.09685)

The engine keeps the frozen base weights once (loaded from the model directory, never published
again) and holds the adapters beside them, one flat buffer for the whole model, so a publication of
a LoRA run is a few MB of A and B factors instead of the whole model. The factors keep PEFT's names
and shapes: `model.layers.{i}.self_attn.q_proj.lora_A.weight` [rank, in], `...lora_B.weight` [out, rank].

Per layer the engine's fused linears get one low-rank pair each, so a layer runs at most eight
extra small matmuls whatever the number of targeted projections:

    qkv      A_qkv [n r, hidden] = the targeted projections' A stacked; B_qkv [q + 2 kv, n r] block-
             diagonal (q_proj's B in rows 0..q, columns 0..r, ...); zeros elsewhere stay zero
    o        A [r, q_size], B [hidden, r]
    gate_up  like qkv over [gate; up]
    down     A [r, intermediate], B [hidden, r]

Each HF tensor is a view into those blocks (a B view is strided), so an update copies straight
into the engine's storage, as full-weight publication does. Why at run time and not merged into the
weights at each publication: merging rewrites every targeted weight (most of the model) at each
switch, needs either a second copy of the base or an in-place update that drifts in 16-bit dtypes,
while the run-time pairs cost some decode speed; the measured figures are in docs/native-engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.backends.lora_names import PROJECTIONS, factor_name, projection_shapes
from hybridrl.backends.model_spec import ModelSpec

# the engine's fused linear each HF projection belongs to, in the order its rows lie there
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


@dataclass(frozen=True)
class LoraSpec:
    """What the engine must know of a run's adapters: rank, alpha, the targeted HF projections."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        unknown = [m for m in self.target_modules if m not in PROJECTIONS]
        if self.rank <= 0 or unknown or not self.target_modules:
            raise ValueError(f"LoRA adapters need rank > 0 and targets among {list(PROJECTIONS)}; got rank "
                             f"{self.rank}, targets {list(self.target_modules)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class FusedAdapter:
    a: torch.Tensor          # [n * rank, in]: the targeted projections' A stacked
    b: torch.Tensor          # [rows of the fused linear, n * rank]: their B block-diagonally


class LoraWeights:
    """Every layer's adapters (`layers[i]`: fused linear name -> FusedAdapter), views of one flat
    buffer (zero at start: the base model), and their HF-named views (`views`)."""

    def __init__(self, spec: ModelSpec, lora: LoraSpec, *, dtype: torch.dtype, device: torch.device):
        if spec.is_moe and any(p in lora.target_modules for p in FUSED["gate_up"] + FUSED["down"]):
            raise ValueError("LoRA on a mixture-of-experts model's MLP projections is not supported by the native "
                             "engine: target the attention projections only (train.lora.target_modules)")
        self.spec, self.lora, self.scale = spec, lora, lora.scale
        shapes = projection_shapes(spec)
        r = lora.rank
        plan: list[tuple[int, str, tuple[str, ...], int, int]] = []    # layer, fused, targeted, rows, in
        for i in range(spec.num_layers):
            for fused, projections in FUSED.items():
                targeted = tuple(p for p in projections if p in lora.target_modules)
                if targeted:
                    rows = sum(shapes[p][0] for p in projections)
                    plan.append((i, fused, targeted, rows, shapes[projections[0]][1]))
        total = sum(len(t) * r * (inp + rows) for _, _, t, rows, inp in plan)
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        self.layers: list[dict[str, FusedAdapter]] = [{} for _ in range(spec.num_layers)]
        self.views: dict[str, torch.Tensor] = {}
        offset = 0
        for layer, fused, targeted, rows, inp in plan:
            n = len(targeted) * r
            a = self.flat[offset: offset + n * inp].view(n, inp)
            offset += n * inp
            b = self.flat[offset: offset + rows * n].view(rows, n)
            offset += rows * n
            self.layers[layer][fused] = FusedAdapter(a, b)
            row = 0
            for projection in FUSED[fused]:
                out = shapes[projection][0]
                if projection in targeted:
                    k = targeted.index(projection)
                    self.views[factor_name(layer, projection, "A")] = a[k * r: (k + 1) * r]
                    self.views[factor_name(layer, projection, "B")] = b[row: row + out, k * r: (k + 1) * r]
                row += out

    def num_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def lora_spec_of(cfg) -> LoraSpec | None:
    """A run's adapters (`train.lora`) as the engine needs them; None when the run has none."""
    lora = cfg.train.lora
    return LoraSpec(lora.rank, float(lora.alpha), tuple(lora.target_modules)) if lora.rank > 0 else None


def add_low_rank_(out: torch.Tensor, x: torch.Tensor, adapter: FusedAdapter | None, scale: float) -> torch.Tensor:
    """out += scale * (x A^T) B^T in place (out [N, rows], x [N, in]); `out` as it is without an adapter."""
    if adapter is None:
        return out
    return out.addmm_(torch.mm(x, adapter.a.t()), adapter.b.t(), alpha=scale)

