"""LoRA on the actor's Megatron linears: low-rank adapters per HF projection, tensor-parallel.

    delta(x) = (alpha / rank) * B @ A @ dropout(x)       (Hu et al. 2021, arXiv:2106.09685)

One adapter per targeted HF projection (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj), in HF shapes: A [rank, in], B [out, rank]. On Megatron's fused linears each projection
keeps its own pair and its delta is written into the rows its weight occupies (per KV group in
the fused QKV, [gate_r; up_r] in fc1), so the adapters are exactly PEFT's on the HF model.

Tensor parallelism splits the pair the way the base weight is split:
  column-parallel (linear_qkv, linear_fc1): A replicated, B split along its rows like the weight;
      the rank-r activation h = A x is replicated, and its gradient is summed over TP
      (Megatron's copy-to-region) before it reaches A, so every TP rank holds A's full gradient.
  row-parallel (linear_proj, linear_fc2): A split along its columns like the weight, B replicated;
      h = sum over TP of A_r x_r (reduce-from-region), then B h on every rank.

The base model is frozen (no gradient, no optimizer state); the adapters are the only trained
parameters. With the adapters disabled the model is the base: the frozen reference of a KL term
is the actor itself under `disabled(...)`, no second copy of the weights. Adapters live in one
module, `model.lora`, whose sharded state dict is keyed by global layer index (checkpoints hold
them beside the frozen base, resumable exactly); `full_adapters` gathers their HF tensors for a
PEFT export or a merged publication.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridrl.backends.lora_names import factor_name, module_name, projection_shapes
from hybridrl.backends.megatron.adapters.base import DecoderAdapter, Role
from hybridrl.backends.megatron.config import LORA_PROJECTIONS, LoraConfig

# HF projection -> (the Megatron slot holding it, its index among the slot's HF tensors)
PROJECTIONS: dict[str, tuple[Role, int]] = {
    "q_proj": (Role.QKV_WEIGHT, 0), "k_proj": (Role.QKV_WEIGHT, 1), "v_proj": (Role.QKV_WEIGHT, 2),
    "o_proj": (Role.PROJ_WEIGHT, 0),
    "gate_proj": (Role.FC1_WEIGHT, 0), "up_proj": (Role.FC1_WEIGHT, 1),
    "down_proj": (Role.FC2_WEIGHT, 0),
}
assert tuple(PROJECTIONS) == LORA_PROJECTIONS
_ROW_PARALLEL = (Role.PROJ_WEIGHT, Role.FC2_WEIGHT)
def _key(layer: int, projection: str) -> str:
    return f"{layer}_{projection}"


class LoraAdapters(torch.nn.Module):
    """This rank's adapter factors (its stage's layers, its TP shard), `A` and `B` keyed `{layer}_{proj}`,
    and the switch that turns them off (`enabled`)."""

    def __init__(self, cfg: LoraConfig, adapter: DecoderAdapter, layers: Mapping[int, Any], *,
                 tp_rank: int, seed: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg, self.tp, self.tp_rank = cfg, adapter.tp, tp_rank
        self.enabled = True
        self.merge_factors: tuple | None = None    # device_factors' cache: (gathered factors, device, moved)
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        shapes = projection_shapes(adapter.spec)
        for layer in sorted(layers):
            for proj in cfg.target_modules:
                out_features, in_features = shapes[proj]
                a, b = init_factors(cfg.rank, in_features, out_features, seed=seed, layer=layer, projection=proj)
                a, b = self.shard(proj, a, b)
                self.A[_key(layer, proj)] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
                self.B[_key(layer, proj)] = torch.nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
        self._mark_tensor_parallel()

    def shard(self, proj: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This TP rank's part of full HF factors A [r, in], B [out, r]."""
        if PROJECTIONS[proj][0] in _ROW_PARALLEL:
            return a.chunk(self.tp, dim=1)[self.tp_rank], b
        return a, b.chunk(self.tp, dim=0)[self.tp_rank]

    def _mark_tensor_parallel(self) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for key in self.A:
            row = PROJECTIONS[key.split("_", 1)[1]][0] in _ROW_PARALLEL
            split, dim = (self.A[key], 1) if row else (self.B[key], 0)
            set_tensor_model_parallel_attributes(split, True, dim, 1)

    def items(self) -> Iterator[tuple[int, str, torch.nn.Parameter, torch.nn.Parameter]]:
        for key in self.A:
            layer, proj = key.split("_", 1)
            yield int(layer), proj, self.A[key], self.B[key]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None,
                           **_: Any) -> dict:
        """Keys by global layer (no pipeline offsets needed); the TP-split factor of each pair is sharded,
        the other replicated over TP."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        dp = ps.get_data_parallel_rank(with_context_parallel=True)
        out = {}
        for name, param in self.named_parameters():
            if getattr(param, "tensor_model_parallel", False):
                out[prefix + name] = ShardedTensor.from_rank_offsets(
                    prefix + name, param, (param.partition_dim, self.tp_rank, self.tp), replica_id=(0, 0, dp))
            else:
                out[prefix + name] = ShardedTensor.from_rank_offsets(prefix + name, param,
                                                                     replica_id=(0, self.tp_rank, dp))
        return out

    # -------------------------------------------------------------------------- the forward

    def delta(self, layer: int, role: Role, x: torch.Tensor, local_rows: list[int], groups: int) -> torch.Tensor | None:
        """What the adapters add to one Megatron linear's local output for input `x` [..., in_local];
        None when none of its projections is targeted. `local_rows`: this rank's output rows of each
        of the slot's HF projections; `groups`: this rank's KV groups (the fused QKV interleaves by them)."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        names = [p for p, (r, _) in sorted(PROJECTIONS.items(), key=lambda kv: kv[1][1]) if r is role]
        keys = [_key(layer, p) if _key(layer, p) in self.A else None for p in names]
        if not self.enabled or not any(keys):
            return None
        x = F.dropout(x, self.cfg.dropout, self.training) if self.cfg.dropout else x
        scale = self.cfg.scale
        if role in _ROW_PARALLEL:
            h = reduce_from_tensor_model_parallel_region(F.linear(x, self.A[keys[0]]))
            return F.linear(h, self.B[keys[0]]) * scale
        parts = []
        for key, rows in zip(keys, local_rows):
            if key is None:
                parts.append(x.new_zeros(*x.shape[:-1], rows))
            else:
                h = copy_to_tensor_model_parallel_region(F.linear(x, self.A[key]))
                parts.append(F.linear(h, self.B[key]) * scale)
        if role is Role.QKV_WEIGHT:         # per KV group: its query heads, its key head, its value head
            lead = x.shape[:-1]
            parts = [p.reshape(*lead, groups, -1) for p in parts]
            return torch.cat(parts, dim=-1).reshape(*lead, -1)
        return torch.cat(parts, dim=-1)     # fc1: [gate_r; up_r]


def init_factors(rank: int, in_features: int, out_features: int, *, seed: int, layer: int,
                 projection: str) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's initialisation (A Kaiming-uniform with a=sqrt(5), B zero), drawn from a generator of its own
    per (seed, layer, projection): the same full factors under every parallel layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + list(PROJECTIONS).index(projection))
    bound = 1.0 / math.sqrt(in_features)     # kaiming_uniform_(a=sqrt(5)) on a [rank, in] matrix
    a = (torch.rand(rank, in_features, generator=g, dtype=torch.float32) * 2 - 1) * bound
    return a, torch.zeros(out_features, rank)


# ------------------------------------------------------------------------------ attaching


def _linear(layer_module, role: Role):
    if role is Role.QKV_WEIGHT:
        return layer_module.self_attention.linear_qkv
    if role is Role.PROJ_WEIGHT:
        return layer_module.self_attention.linear_proj
    if role is Role.FC1_WEIGHT:
        return layer_module.mlp.linear_fc1
    return layer_module.mlp.linear_fc2


def attach(model, adapter: DecoderAdapter, cfg: LoraConfig, layers: Mapping[int, Any], *, seed: int,
           dtype: torch.dtype, device: torch.device) -> LoraAdapters:
    """Freeze `model` and give it adapters (`model.lora`), applied by forward hooks on the targeted
    linears. Call before the optimizer is built: it sees only the adapters."""
    from megatron.core import parallel_state as ps

    model.requires_grad_(False)
    lora = LoraAdapters(cfg, adapter, layers, tp_rank=ps.get_tensor_model_parallel_rank(), seed=seed,
                        dtype=dtype, device=device)
    model.lora = lora
    spec, tp = adapter.spec, adapter.tp
    shapes = projection_shapes(spec)
    roles = {PROJECTIONS[p][0] for p in cfg.target_modules}
    for index, layer_module in layers.items():
        for role in roles:
            names = [p for p, (r, _) in sorted(PROJECTIONS.items(), key=lambda kv: kv[1][1]) if r is role]
            rows = [shapes[p][0] // tp for p in names]
            _linear(layer_module, role).register_forward_hook(
                _hook(lora, index, role, rows, spec.num_kv_heads // tp))
    return lora


def _hook(lora: LoraAdapters, layer: int, role: Role, rows: list[int], groups: int):
    def add_delta(module, args, output):
        out, bias = output
        d = lora.delta(layer, role, args[0], rows, groups)
        return output if d is None else (out + d.to(out.dtype), bias)

    return add_delta


@contextlib.contextmanager
def disabled(model):
    """The base model: adapters off for the duration (the frozen reference's forward)."""
    lora = model.lora
    before, lora.enabled = lora.enabled, False
    try:
        yield
    finally:
        lora.enabled = before


# ------------------------------------------------------------------------------ full HF tensors


def full_adapters(lora: LoraAdapters) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name -> (A [r, in], B [out, r]) of the whole model, on every rank of this model-parallel
    group (gathered over TP, then over PP); CPU float32 copies."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    local: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, proj, a, b in lora.items():
        a, b = a.detach(), b.detach()
        if lora.tp > 1:
            row = PROJECTIONS[proj][0] in _ROW_PARALLEL
            split, dim = (a, 1) if row else (b, 0)
            parts = [torch.empty_like(split) for _ in range(lora.tp)]
            dist.all_gather(parts, split.contiguous(), group=tp_group)
            whole = torch.cat(parts, dim=dim)
            a, b = (whole, b) if row else (a, whole)
        local[module_name(layer, proj)] = (a.float().cpu().clone(), b.float().cpu().clone())
    pp_group = ps.get_pipeline_model_parallel_group()
    if dist.get_world_size(pp_group) == 1:
        return local
    stages: list = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, local, group=pp_group)
    return {k: v for stage in stages for k, v in stage.items()}


def gathered(engine) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The engine's `full_adapters`, gathered once until its adapters next change (a step, a load)."""
    if engine.lora is None:
        raise RuntimeError("lora_factors: this engine has no LoRA adapters (train.lora.rank is 0)")
    if engine._lora_full is None:
        with engine._scope():
            engine._lora_full = full_adapters(engine.lora)
    return engine._lora_full


def device_factors(engine, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`gathered(engine)` on `device`: moved once per change of the adapters (rank-r factors: megabytes),
    so that a merge multiplies B A where the weights are instead of on the host."""
    full = gathered(engine)
    cached = engine.lora.merge_factors
    if cached is None or cached[0] is not full or cached[1] != device:
        moved = {name: (a.to(device), b.to(device)) for name, (a, b) in full.items()}
        engine.lora.merge_factors = cached = (full, device, moved)
    return cached[2]


def addmm_merge_(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """weight += scale * B @ A, in place, on the weight's device, in its dtype (one rounding of the sum; the
    float32 factors rounded to a narrower weight dtype first: far below that dtype's step of the weight)."""
    if a.dtype != weight.dtype:
        a, b = a.to(weight.dtype), b.to(weight.dtype)
    return weight.addmm_(b, a, alpha=scale)


def merge_fn(engine):
    """name, tensor -> the tensor with its adapter's scale * B @ A added (a new tensor), or as it is."""
    if engine.lora is None:
        return lambda name, tensor: tensor
    return functools.partial(_merged_copy, engine, engine.cfg.lora.scale)


def _merged_copy(engine, scale: float, name: str, tensor: torch.Tensor) -> torch.Tensor:
    module = name.removesuffix(".weight")
    if module not in gathered(engine):
        return tensor
    a, b = device_factors(engine, tensor.device)[module]
    return addmm_merge_(tensor.clone(), a, b, scale)


def add_merged_(engine, out: Mapping[str, torch.Tensor], names) -> None:
    """Add each adapter's scale * B @ A to its base weight `out[name]` for `names` (the HF tensors just
    written; `out` may hold a whole bucket, whose other tensors are not this call's), in place, on the
    device `out` is on (`addmm_`: no full-size delta made on the host or copied to the device)."""
    full, scale = gathered(engine), engine.cfg.lora.scale
    for name in names:
        module = name.removesuffix(".weight")
        if module in full:
            weight = out[name]
            a, b = device_factors(engine, weight.device)[module]
            addmm_merge_(weight, a, b, scale)


class AdapterSource:
    """The actor's adapters as a publication source (`publication.publish.WeightSource`): the tensors a
    LoRA run publishes into an engine that holds the frozen base and applies the adapters itself (the
    native engine, `backends/native/lora.py`). One group per layer, in the order that engine stores
    them (per fused linear the A factors, then the B factors), in the trainer's dtype."""

    def __init__(self, engine):
        self.engine = engine
        self._names: list[list[str]] | None = None

    def hf_group_specs(self) -> list[list[tuple[str, tuple[int, ...], torch.dtype]]]:
        from hybridrl.backends.megatron.model import DTYPES

        engine, dtype = self.engine, DTYPES[self.engine.cfg.dtype]
        shapes, rank, targets = projection_shapes(engine.adapter.spec), engine.cfg.lora.rank, engine.cfg.lora.target_modules
        groups = []
        for layer in range(engine.adapter.spec.num_layers):
            group = []
            for role in (Role.QKV_WEIGHT, Role.PROJ_WEIGHT, Role.FC1_WEIGHT, Role.FC2_WEIGHT):
                mine = [p for p in PROJECTIONS if PROJECTIONS[p][0] is role and p in targets]
                group += [(factor_name(layer, p, "A"), (rank, shapes[p][1]), dtype) for p in mine]
                group += [(factor_name(layer, p, "B"), (shapes[p][0], rank), dtype) for p in mine]
            groups.append(group)
        return groups

    def hf_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Name -> (shape, dtype) of every published factor (what an engine applying them must hold)."""
        return {name: (shape, dtype) for group in self.hf_group_specs() for name, shape, dtype in group}

    def write_hf_group(self, index: int, out: Mapping[str, torch.Tensor]) -> None:
        """Write the factors of group `index` into `out` (every rank of the model-parallel group calls it:
        the first call after a step gathers the adapters)."""
        if self._names is None:
            self._names = [[name for name, _, _ in group] for group in self.hf_group_specs()]
        factors = gathered(self.engine)
        with torch.no_grad():
            for name in self._names[index]:
                module, factor = name.removesuffix(".weight").rsplit(".lora_", 1)
                out[name].copy_(factors[module][0 if factor == "A" else 1])


def load_full(lora: LoraAdapters, factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Set this rank's shards from full HF factors (every adapter of this stage must be given)."""
    with torch.no_grad():
        for layer, proj, a, b in lora.items():
            name = module_name(layer, proj)
            if name not in factors:
                raise KeyError(f"no LoRA factors for {name}")
            sa, sb = lora.shard(proj, *factors[name])
            if sa.shape != a.shape or sb.shape != b.shape:
                raise ValueError(f"{name}: LoRA factors of shapes {tuple(factors[name][0].shape)}, "
                                 f"{tuple(factors[name][1].shape)} do not fit rank {lora.cfg.rank} on this model")
            a.copy_(sa)
            b.copy_(sb)


def trainable_numel(model) -> tuple[int, int]:
    """(parameters that train, parameters that are frozen) of a model, by count."""
    on = sum(p.numel() for p in model.parameters() if p.requires_grad)
    off = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return on, off


# ------------------------------------------------------------------------------ the reference


class BaseModel:
    """The actor's frozen base (adapters off) as a frozen engine: its `compute_logprobs` is the
    reference's, on the actor's own weights, routing on its own as a separate reference does (MoE:
    `moe.own_routing`, the rollout's routes are not replayed in it). Counts its own passes; its layout
    (device, mesh, head, which ranks return outputs, the data-parallel reductions) is the actor's."""

    training = False

    def __init__(self, actor):
        self.actor = actor
        self.passes = {"logprobs": 0, "train": 0}
        self.device, self.mesh, self.head = actor.device, actor.mesh, actor.head

    @property
    def is_loss_rank(self) -> bool:
        return self.actor.is_loss_rank

    @property
    def is_output_rank(self) -> bool:
        return self.actor.is_output_rank

    def dp_sum(self, tensor):
        return self.actor.dp_sum(tensor)

    def dp_max(self, tensor):
        return self.actor.dp_max(tensor)

    def compute_logprobs(self, batch, **kwargs):
        from hybridrl.backends.megatron import moe

        before = dict(self.actor.passes)
        with disabled(self.actor.model), moe.own_routing(self.actor.model):    # a reference routes itself
            out = self.actor.compute_logprobs(batch, **kwargs)
        self.passes["logprobs"] += self.actor.passes["logprobs"] - before["logprobs"]
        self.actor.passes.update(before)
        return out

    def compute_logits(self, batch):
        from hybridrl.backends.megatron import moe

        with disabled(self.actor.model), moe.own_routing(self.actor.model):
            return self.actor.compute_logits(batch)


# ------------------------------------------------------------------------------ PEFT export


def peft_config(cfg: LoraConfig, base_model: str) -> dict:
    """PEFT's adapter_config.json for these adapters (peft.LoraConfig's fields)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
            "target_modules": list(cfg.target_modules), "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "inference_mode": True,
            "modules_to_save": None}


def peft_tensors(factors: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """PEFT's adapter_model.safetensors names (`base_model.model.<module>.lora_{A,B}.weight`)."""
    out = {}
    for module, (a, b) in sorted(factors.items()):
        out[f"base_model.model.{module}.lora_A.weight"] = a.to(dtype).contiguous()
        out[f"base_model.model.{module}.lora_B.weight"] = b.to(dtype).contiguous()
    return out


def export_peft(engine, out_dir) -> None:
    """Rank 0 writes the PEFT directory from the gathered adapters (one model-parallel group gathers)."""
    import json

    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    from hybridrl.backends.megatron.model import DTYPES

    if engine.lora is None:
        raise RuntimeError("export_peft: this engine has no LoRA adapters (train.lora.rank is 0); export_hf "
                           "writes the full model")
    factors = engine.lora_factors() if ps.get_data_parallel_rank() == 0 else None
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(peft_tensors(factors, DTYPES[engine.cfg.dtype]), str(out_dir / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        (out_dir / "adapter_config.json").write_text(
            json.dumps(peft_config(engine.cfg.lora, str(engine.model_dir)), indent=2) + "\n")
    dist.barrier()
