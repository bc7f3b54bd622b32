"""Small collectives every part of a rank uses: which device a group's backend needs, and scalars
reduced over a group.

    collective_device(group, device)     NCCL reduces no CPU tensor, gloo no CUDA tensor
    Reducer(all_reduce, device)          sum / max / any of a few floats over one group

A `Reducer` wraps whichever way the group is reached (a torch group, or `Peers` for the job-wide
groups of a placement whose roles have worlds of their own), so every "add these up over the
ranks" in the workers is one call.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


def backend_device(backend: str, device: torch.device) -> torch.device:
    """Where a collective of `backend` needs its tensors."""
    backend = str(backend).lower()
    if "nccl" in backend:
        return device if device.type == "cuda" else torch.device("cuda")
    if backend == "gloo":
        return torch.device("cpu")
    return device


def collective_device(group: Any, device: torch.device) -> torch.device:
    """The device a collective on `group` (a torch process group, or None for the default one) needs."""
    return backend_device(dist.get_backend(group), device)


class Reducer:
    """Reductions of a few Python floats over one group, on the device its backend needs."""

    def __init__(self, all_reduce: Callable[[torch.Tensor, Any], Any], device: torch.device):
        self._all_reduce, self.device = all_reduce, device

    @classmethod
    def over_peers(cls, peers: Any) -> "Reducer":
        """Over a `Peers` (job ranks), whose backend is its process group's."""
        return cls(lambda t, op: peers.all_reduce(t, op=op), backend_device(peers.group.name(), torch.device("cpu")))

    @classmethod
    def over_group(cls, group: Any, device: torch.device = torch.device("cpu")) -> "Reducer":
        """Over a torch process group (None: the default world)."""
        return cls(lambda t, op: dist.all_reduce(t, op=op, group=group), collective_device(group, device))

    def _reduce(self, values: Sequence[float], op) -> list[float]:
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        self._all_reduce(t, op)
        return t.cpu().tolist()

    def sum(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: Sequence[float]) -> list[float]:
        return self._reduce(values, dist.ReduceOp.MAX)

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on some rank."""
        return self.max([1.0 if flag else 0.0])[0] > 0

    def count(self, flag: bool) -> int:
        """On how many ranks `flag` holds."""
        return int(self.sum([1.0 if flag else 0.0])[0])
