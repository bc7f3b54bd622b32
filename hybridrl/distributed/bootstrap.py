"""Process-group bootstrap: every rank gets a control plane (gloo + store) and a data plane.

Run under `torchrun` (or anything that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). The default process group uses the data-plane backend (NCCL with CUDA, gloo
otherwise), so Megatron's groups built from it use the fast backend; a separate gloo group
carries control-plane collectives, and a dedicated data group carries the controller's tensors.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridrl.distributed.config import DistributedConfig
from hybridrl.distributed.control import ControlPlane

log = logging.getLogger(__name__)

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistContext:
    """What a rank knows about the job's processes."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    data_backend: str                    # "nccl" | "gloo"
    control_group: dist.ProcessGroup     # gloo: small object collectives
    data_group: dist.ProcessGroup        # the controller's tensor transfers
    control: ControlPlane                # store-based commands / status / heartbeats (main thread)
    cfg: DistributedConfig

    @property
    def is_controller(self) -> bool:
        return self.rank == 0


def pick_device(cfg: DistributedConfig, local_rank: int) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("distributed.device=cuda but torch sees no CUDA device")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(cfg: DistributedConfig) -> DistContext:
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"not launched by torchrun: {', '.join(missing)} unset. Use `hybridrl train RECIPE` or "
            "`torchrun --nproc-per-node N -m hybridrl.train --config RECIPE`")
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device = pick_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.init_timeout_s)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart > 0:
            # torchrun restarted the ranks: its store keeps the earlier attempt's keys, under which
            # sub-groups would find the dead ranks' addresses. Each attempt gets its own prefix.
            store = dist.PrefixStore(f"hybridrl-attempt-{restart}/", dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout))
            kwargs["store"] = store
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    # Collectives and p2p of the data plane may legitimately wait for long steps on other ranks;
    # a dead peer is found by the watchdog, not by these timeouts.
    long = timedelta(seconds=max(cfg.call_timeout_s, cfg.init_timeout_s) + 60)
    control_group = dist.new_group(backend="gloo", timeout=long)
    data_group = dist.new_group(backend=backend, timeout=long)
    store = dist.PrefixStore("hybridrl/", dist.distributed_c10d._get_default_store())
    control = ControlPlane(store, rank, world_size)
    control.register_process(socket.gethostname(), os.getpid())
    log.debug("rank %d/%d up on %s (data plane %s)", rank, world_size, device, backend)
    return DistContext(rank, world_size, local_rank, local_world_size, device, backend,
                       control_group, data_group, control, cfg)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
