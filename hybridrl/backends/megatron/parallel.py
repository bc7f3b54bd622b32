"""Megatron's parallel state for (tp, pp, dp), and our `Mesh` that mirrors its rank order."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from hybridrl.distributed.mesh import Mesh, train_mesh

log = logging.getLogger(__name__)

__all__ = ["all_reduce", "destroy_model_parallel", "ensure_model_parallel", "train_mesh"]


def ensure_model_parallel(tp: int, pp: int, seed: int) -> Mesh:
    """Initialise Megatron's parallel state (once per process) and check it matches (tp, pp)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "hybridrl.distributed.bootstrap.init_distributed (or init_process_group) first")
    world = dist.get_world_size()
    mesh = train_mesh(world, tp, pp)
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise RuntimeError(f"Megatron parallel state is already (tp={have[0]}, pp={have[1]}); this engine "
                               f"wants (tp={tp}, pp={pp}). Engines in one process must share the layout.")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        log.debug("megatron parallel state: tp=%d pp=%d dp=%d", tp, pp, mesh.dp_size)
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
