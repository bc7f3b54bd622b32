"""Run under torchrun (2 ranks, gloo): `Peers` over a group that refuses CPU tensors, as NCCL does.

`NcclLike` wraps a real gloo group: it names itself "nccl" and refuses any CPU tensor, as
ProcessGroupNCCL does, and moves the data over gloo. Its tensors live on torch's lazy device, a
real non-CPU device that a CPU-only torch has (the stand-in for CUDA here). Rank 0 writes what
each case gave to OUT.json. Usage: python -m tests.distributed.peers_jobs OUT.json"""

from __future__ import annotations

import json
import sys

import torch
import torch._lazy
import torch._lazy.ts_backend
import torch.distributed as dist

from hybridrl.distributed import peers as peers_mod
from hybridrl.distributed.peers import Peers

LAZY = torch.device("lazy", 0)


class NcclLike:
    """Refuses CPU tensors (ProcessGroupNCCL: "Tensors must be CUDA and dense"); moves them over gloo."""

    def __init__(self, gloo):
        self.gloo = gloo
        self.devices_seen: set[str] = set()

    def name(self) -> str:
        return "nccl"

    def _check(self, tensors):
        for t in tensors:
            self.devices_seen.add(t.device.type)
            if t.device.type == "cpu":
                raise RuntimeError("NCCL-like group: Tensors must be CUDA and dense (got a CPU tensor)")

    def _through_gloo(self, tensors, op):
        self._check(tensors)
        cpu = [t.cpu() for t in tensors]
        op(cpu).wait()
        for t, c in zip(tensors, cpu):
            t.copy_(c.to(t.device))
        return _Done()

    def broadcast(self, tensors, opts):
        return self._through_gloo(tensors, lambda cpu: self.gloo.broadcast(cpu, opts))

    def allreduce(self, tensors, opts):
        return self._through_gloo(tensors, lambda cpu: self.gloo.allreduce(cpu, opts))


class _Done:
    def wait(self):
        return True


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch._lazy.ts_backend.init()
    rank = dist.get_rank()
    ranks = [0, 1]
    results: dict = {}

    # a real gloo group: Peers takes the CPU for it
    gloo = Peers(dist.group.WORLD, ranks, rank)
    results["gloo_device"] = str(gloo.device)
    results["gloo_object"] = gloo.broadcast_object({"from": 1, "spec": [1, 2]} if rank == 1 else None, 1)

    # the NCCL-like group: its device comes from the backend's entry (CUDA's here replaced by lazy)
    peers_mod.ACCELERATOR_BACKENDS["nccl"] = lambda: LAZY
    fake = NcclLike(dist.new_group(backend="gloo"))
    nccl = Peers(fake, ranks, rank)
    results["nccl_device"] = str(nccl.device)
    results["nccl_object"] = nccl.broadcast_object({"weights": "spec", "n": 3} if rank == 1 else None, 1)
    flag = torch.tensor([float(rank + 1), -float(rank)], dtype=torch.float64)      # a CPU tensor
    nccl.all_reduce(flag, op=dist.ReduceOp.MAX)
    results["nccl_all_reduce"] = {"values": flag.tolist(), "device": flag.device.type}
    buf = torch.arange(4, dtype=torch.uint8) * (rank + 1)
    nccl.broadcast(buf, 1)
    results["nccl_broadcast"] = buf.tolist()
    results["nccl_devices_seen"] = sorted(fake.devices_seen)

    # what the four call sites did before: buffers on the CPU, refused by the group
    cpu_peers = Peers(fake, ranks, rank, device="cpu")
    try:
        cpu_peers.broadcast_object("spec" if rank == 1 else None, 1)
        results["cpu_buffers"] = "accepted"
    except RuntimeError as err:
        results["cpu_buffers"] = str(err)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(lambda: main(sys.argv[1]))
