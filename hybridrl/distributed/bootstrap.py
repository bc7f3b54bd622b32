"""Process-group bootstrap: every rank gets a control plane (gloo + store) and a data plane.

Run under `torchrun` (or anything that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT). The default process group uses the data-plane backend (NCCL with CUDA, gloo
otherwise), so Megatron's groups built from it use the fast backend; a separate gloo group
carries control-plane collectives, and a dedicated data group carries the controller's tensors.

With a disaggregated placement (`placement.mode=disaggregated`) each role gets a default world of
its own: the training ranks' world is the one Megatron builds its groups from, the rollout ranks'
another. The job-wide control and data groups are then built from the rendezvous store directly
(`peers.build_group`); the control plane's store spans the whole job either way.
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
from hybridrl.distributed.network import bind_interface
from hybridrl.distributed.peers import Peers, build_group
from hybridrl.distributed.placement import PlacementConfig, Roles

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
    control_group: dist.ProcessGroup | None   # gloo: small object collectives (colocated: a torch group)
    data_group: dist.ProcessGroup | None      # the controller's tensor transfers (colocated: a torch group)
    control: ControlPlane                # store-based commands / status / heartbeats (main thread)
    cfg: DistributedConfig
    roles: Roles = None                  # which ranks train and which generate
    control_peers: Peers = None          # job-wide gloo collectives (every placement)
    data_peers: Peers = None             # job-wide tensor transfers (every placement)
    store: dist.Store = None             # the job's rendezvous store (groups beyond the defaults)

    @property
    def is_controller(self) -> bool:
        return self.rank == 0

    @property
    def role(self) -> str:
        """hybrid (colocated: trains and generates) | train | rollout."""
        return self.roles.role(self.rank)


def pick_device(cfg: DistributedConfig, local_rank: int) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("distributed.device=cuda but torch sees no CUDA device")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_distributed(cfg: DistributedConfig, placement: PlacementConfig | None = None) -> DistContext:
    missing = [k for k in _ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"not launched by torchrun: {', '.join(missing)} unset. Use `hybridrl train RECIPE` or "
            "`torchrun --nproc-per-node N -m hybridrl.train --config RECIPE`")
    bind_interface(cfg.socket_ifname)    # before any process group: gloo reads it when it starts
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    roles = Roles.of(placement or PlacementConfig(), world_size)
    device = pick_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=cfg.init_timeout_s)
    # Collectives and p2p of the data plane may legitimately wait for long steps on other ranks;
    # a dead peer is found by the watchdog, not by these timeouts.
    long = timedelta(seconds=max(cfg.call_timeout_s, cfg.init_timeout_s) + 60)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if roles.disaggregated:
        return _init_disaggregated(cfg, roles, rank, local_rank, local_world_size, device, backend, timeout, long,
                                   restart)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if restart > 0:
            # torchrun restarted the ranks: its store keeps the earlier attempt's keys, under which
            # sub-groups would find the dead ranks' addresses. Each attempt gets its own prefix.
            kwargs["store"] = dist.PrefixStore(f"hybridrl-attempt-{restart}/", _job_store(rank, timeout))
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    control_group = dist.new_group(backend="gloo", timeout=long)
    data_group = dist.new_group(backend=backend, timeout=long)
    job_store = dist.distributed_c10d._get_default_store()
    control = ControlPlane.connect(job_store, rank, world_size)
    control.register_process(socket.gethostname(), os.getpid())
    log.debug("rank %d/%d up on %s (data plane %s)", rank, world_size, device, backend)
    everyone = range(world_size)
    return DistContext(rank, world_size, local_rank, local_world_size, device, backend,
                       control_group, data_group, control, cfg, roles=roles,
                       control_peers=Peers(control_group, everyone, rank), data_peers=Peers(data_group, everyone, rank),
                       store=job_store)


def _job_store(rank: int, timeout: timedelta) -> dist.Store:
    """A client of the job's rendezvous store (torchrun's agent hosts it; without an agent, rank 0)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=rank == 0 and not agent, timeout=timeout)


def _init_disaggregated(cfg, roles: Roles, rank: int, local_rank: int, local_world_size: int, device, backend: str,
                        timeout: timedelta, long: timedelta, restart: int) -> DistContext:
    """Each role its own default world (Megatron's groups come from the training ranks' alone); the
    job-wide groups built from the store."""
    store = _job_store(rank, timeout)
    store = dist.PrefixStore(f"hybridrl-attempt-{restart}/", store) if restart > 0 else store
    role = roles.role(rank)
    members = roles.train_ranks if role == "train" else roles.rollout_ranks
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"hybridrl-world/{role}/", store),
                                rank=members.index(rank), world_size=len(members), timeout=timeout, **kwargs)
    everyone = range(roles.world_size)
    control_peers = build_group(store, "control", everyone, rank, backend="gloo", timeout=long)
    data_peers = build_group(store, "data", everyone, rank, backend=backend, timeout=long)
    control = ControlPlane.connect(store, rank, roles.world_size)
    control.register_process(socket.gethostname(), os.getpid())
    log.debug("rank %d/%d up on %s as a %s rank (data plane %s)", rank, roles.world_size, device, role, backend)
    return DistContext(rank, roles.world_size, local_rank, local_world_size, device, backend, None, None, control,
                       cfg, roles=roles, control_peers=control_peers, data_peers=data_peers, store=store)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
