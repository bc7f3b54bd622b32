"""Megatron's parallel state for (tp, pp, dp), and our `Mesh` that mirrors its rank order."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from hybridrl.backends.megatron import upstream  # noqa: F401  (megatron-core imported first, there)
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from hybridrl.distributed.mesh import Mesh, train_mesh

log = logging.getLogger(__name__)

__all__ = ["all_reduce", "destroy_model_parallel", "ensure_model_parallel", "train_mesh"]


def ensure_model_parallel(tp: int, pp: int, seed: int, ep: int | None = None) -> Mesh:
    """Initialise Megatron's parallel state (once per process) and check it matches (tp, pp, ep).
    Experts are split over `ep` ranks of the data-parallel group, and over the TP group like the
    dense MLP (expert_tensor_parallel_size = tp). `ep=None`: whatever is set (1 when initialising)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "hybridrl.distributed.bootstrap.init_distributed (or init_process_group) first")
    world = dist.get_world_size()
    mesh = train_mesh(world, tp, pp)
    if ep is not None and mesh.dp_size % ep:
        raise ValueError(f"ep={ep} does not divide the data-parallel size {mesh.dp_size}")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size())
        if have != (tp, pp, have[2] if ep is None else ep):
            raise RuntimeError(f"Megatron parallel state is already (tp={have[0]}, pp={have[1]}, ep={have[2]}); this "
                               f"engine wants (tp={tp}, pp={pp}, ep={ep}). Engines in one process must share the layout.")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep or 1, expert_tensor_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        log.debug("megatron parallel state: tp=%d pp=%d dp=%d ep=%d", tp, pp, mesh.dp_size, ep or 1)
    coords = mesh.coords(dist.get_rank())
    megatron = {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
                "dp": ps.get_data_parallel_rank()}
    if coords != {a: megatron[a] for a in mesh.axes}:
        raise RuntimeError(f"mesh coordinates {coords} disagree with Megatron's {megatron}")
    return mesh


def destroy_model_parallel() -> None:
    """Tear down Megatron's parallel state (tests that change layouts inside one process)."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def all_reduce(value: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, op=op, group=group)
    return value
