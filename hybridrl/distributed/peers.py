"""`Peers`: collectives and point-to-point over a process group object, by the group's own ranks.

The controller's data plane and the control collectives span every rank of the job. In the
colocated placement that is torch's default world, and the groups come from `dist.new_group`. In
the disaggregated placement each role has a world of its own (Megatron builds its groups from
the training ranks' world only), so the job-wide groups are built directly from the rendezvous
store (`build_group`) and are unknown to `torch.distributed`'s module-level functions. `Peers`
calls the process group's own methods, which work for both kinds.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

_TAG = 0


class Peers:
    """A process group whose ranks are `ranks` (job ranks, in group order). `me` is this process's
    job rank; every method takes and returns job ranks."""

    def __init__(self, group: Any, ranks: Sequence[int], me: int):
        self.group = group
        self.ranks = list(ranks)
        self.me = me
        self._index = {r: i for i, r in enumerate(self.ranks)}

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def isend(self, tensor: torch.Tensor, dst: int):
        return self.group.send([tensor], self._index[dst], _TAG)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self.group.recv([tensor], self._index[src], _TAG).wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = self._index[src]
        self.group.broadcast([tensor], opts).wait()

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.group.allreduce([tensor], opts).wait()
        return tensor

    def broadcast_object(self, obj: Any, src: int, device: torch.device | None = None) -> Any:
        """A picklable object from `src` to every member (its length first, then its bytes)."""
        device = device or torch.device("cpu")
        if self.me == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
            size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
        else:
            size = torch.zeros(1, dtype=torch.long, device=device)
        self.broadcast(size, src)
        if self.me != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.broadcast(payload, src)
        return obj if self.me == src else pickle.loads(payload.cpu().numpy().tobytes())


def build_group(store: dist.Store, name: str, ranks: Sequence[int], me: int, *, backend: str,
                timeout: timedelta) -> Peers | None:
    """A process group over `ranks` (job ranks) built from `store`, outside torch's default world;
    every member calls it with the same `name` and `ranks`. None on a rank that is not a member."""
    ranks = list(ranks)
    if me not in ranks:
        return None
    prefixed = dist.PrefixStore(f"hybridrl-group/{name}/", store)
    index = ranks.index(me)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, index, len(ranks), opts)
    else:
        group = dist.ProcessGroupGloo(prefixed, index, len(ranks), timeout)
    return Peers(group, ranks, me)
