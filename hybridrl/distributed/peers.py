"""`Peers`: collectives and point-to-point over a process group object, by the group's own ranks.

The controller's data plane and the control collectives span every rank of the job. In the
colocated placement that is torch's default world, and the groups come from `dist.new_group`. In
the disaggregated placement each role has a world of its own (Megatron builds its groups from
the training ranks' world only), so the job-wide groups are built directly from the rendezvous
store (`build_group`) and are unknown to `torch.distributed`'s module-level functions. `Peers`
calls the process group's own methods, which work for both kinds.

Each `Peers` knows the device its group's collectives take their tensors on (`collective_device`):
an NCCL group refuses CPU tensors, so its collectives run on this rank's current CUDA device; a
gloo group takes CPU tensors. `broadcast_object` builds its buffers there, and `broadcast` /
`all_reduce` stage a tensor through that device when it lives elsewhere, so no call site has to
remember which backend its group has.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

_TAG = 0

# backend name (ProcessGroup.name()) -> the device its collectives need; backends not named here
# (gloo) take CPU tensors. NCCL runs on the rank's current CUDA device (bootstrap sets it).
ACCELERATOR_BACKENDS: dict[str, Callable[[], torch.device]] = {
    "nccl": lambda: torch.device("cuda", torch.cuda.current_device()),
}


def backend_name(group: Any) -> str:
    """The backend of a process group object ('nccl', 'gloo', ...), lower case."""
    name = group.name() if hasattr(group, "name") else ""
    return str(name).lower()


def collective_device(group: Any) -> torch.device:
    """The device `group`'s collectives take their tensors on (see the module doc)."""
    device = ACCELERATOR_BACKENDS.get(backend_name(group))
    return device() if device is not None else torch.device("cpu")


class Peers:
    """A process group whose ranks are `ranks` (job ranks, in group order). `me` is this process's
    job rank; every method takes and returns job ranks. `device`: where the group's collectives take
    their tensors (default: by its backend, `collective_device`)."""

    def __init__(self, group: Any, ranks: Sequence[int], me: int, device: torch.device | str | None = None):
        self.group = group
        self.ranks = list(ranks)
        self.me = me
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self.device = torch.device(device) if device is not None else collective_device(group)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def isend(self, tensor: torch.Tensor, dst: int):
        """Point-to-point as given: the caller puts the tensor on `self.device` (its buffer must stay
        alive until the returned work completes, so it is not staged here)."""
        return self.group.send([tensor], self._index[dst], _TAG)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        buf = self._staged(tensor)
        self.group.recv([buf], self._index[src], _TAG).wait()
        if buf is not tensor:
            tensor.copy_(buf.to(tensor.device))

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = self._index[src]
        buf = self._staged(tensor)
        self.group.broadcast([buf], opts).wait()
        if buf is not tensor:
            tensor.copy_(buf.to(tensor.device))

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        buf = self._staged(tensor)
        self.group.allreduce([buf], opts).wait()
        if buf is not tensor:
            tensor.copy_(buf.to(tensor.device))
        return tensor

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` itself, or a copy on `self.device` when the group needs an accelerator device the
        tensor is not on (a gloo group takes CPU and CUDA tensors alike: nothing to stage)."""
        if self.device.type == "cpu" or tensor.device == self.device:
            return tensor
        return tensor.to(self.device)

    def broadcast_object(self, obj: Any, src: int, device: torch.device | None = None) -> Any:
        """A picklable object from `src` to every member (its length first, then its bytes), through
        buffers on `device` (default: the group's own, `self.device`)."""
        device = torch.device(device) if device is not None else self.device
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
