"""The control plane: small pickled messages through the rendezvous key-value store.

Commands, per-rank status, error reports, heartbeats and the abort flag live here. They are
small by construction: `encode` refuses any torch.Tensor, so bulk data can only move over the
data plane (`transport.py`). Every operation is a short store round trip that the caller can
poll, so no thread ever blocks where it cannot notice an abort.

Keys (under the `hybridrl/` prefix):
  cmd/<seq>            the controller's command number <seq>, read by every worker
  status/<seq>/<rank>  a rank's outcome of command <seq> (and the metadata of its output)
  errors, error/<i>    counter and reports of failures, in the order they happened
  hb/<rank>            heartbeat counter of a rank
  proc/<rank>          (hostname, pid) of a rank, for fast death detection on one host
  abort                set once: every rank exits
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist


class ControlMessageError(TypeError):
    """Something that must not travel through the control plane (a tensor) was given to it."""


class _NoTensorPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            raise ControlMessageError(
                f"a torch.Tensor of shape {tuple(obj.shape)} was put in a control message; "
                "bulk tensors travel in a Batch over the data plane")
        return NotImplemented


def encode(obj: Any) -> bytes:
    buf = io.BytesIO()
    _NoTensorPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def decode(data: bytes) -> Any:
    return pickle.loads(data)


@dataclass(frozen=True)
class ErrorReport:
    """One rank's failure: what it was doing and its formatted traceback."""

    rank: int
    method: str
    kind: str          # "exception" | "died" | "silent" | "timeout"
    message: str
    traceback: str = ""
    at: float = 0.0


class ControlPlane:
    """Typed operations over a store client. Not thread-safe: use `clone()` per thread."""

    def __init__(self, store: dist.Store, rank: int, world_size: int):
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def clone(self) -> "ControlPlane":
        return ControlPlane(self.store.clone(), self.rank, self.world_size)

    # commands and status -------------------------------------------------------------------

    def post_command(self, seq: int, command: Any) -> None:
        """`command` may be pre-encoded bytes."""
        self.store.set(f"cmd/{seq}", command if isinstance(command, bytes) else encode(command))

    def try_command(self, seq: int) -> Any | None:
        """The command `seq` if it has been posted, else None (never blocks)."""
        key = f"cmd/{seq}"
        if not self.store.check([key]):
            return None
        return decode(self.store.get(key))

    def post_status(self, seq: int, status: Any) -> None:
        self.store.set(f"status/{seq}/{self.rank}", encode(status))

    def ready_statuses(self, seq: int, ranks: Sequence[int]) -> list[int]:
        keys = [f"status/{seq}/{r}" for r in ranks]
        return [r for r, k in zip(ranks, keys) if self.store.check([k])]

    def status(self, seq: int, rank: int) -> Any:
        return decode(self.store.get(f"status/{seq}/{rank}"))

    def forget(self, seq: int, ranks: Sequence[int]) -> None:
        for key in [f"cmd/{seq}"] + [f"status/{seq}/{r}" for r in ranks]:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - deleting is best effort
                pass

    # failures --------------------------------------------------------------------------------

    def report_error(self, report: ErrorReport) -> None:
        index = self.store.add("errors", 1) - 1
        self.store.set(f"error/{index}", encode(report))

    def num_errors(self) -> int:
        return self.store.add("errors", 0)

    def error(self, index: int) -> ErrorReport | None:
        key = f"error/{index}"
        if not self.store.check([key]):
            return None  # the counter moved first; the report lands a moment later
        return decode(self.store.get(key))

    def abort(self, reason: str) -> None:
        self.store.set("abort", reason.encode())

    def aborted(self) -> str | None:
        if self.store.check(["abort"]):
            return self.store.get("abort").decode()
        return None

    # liveness ---------------------------------------------------------------------------------

    def register_process(self, hostname: str, pid: int) -> None:
        self.store.set(f"proc/{self.rank}", encode((hostname, pid)))

    def process(self, rank: int) -> tuple[str, int] | None:
        key = f"proc/{rank}"
        return decode(self.store.get(key)) if self.store.check([key]) else None

    def beat(self) -> None:
        self.store.add(f"hb/{self.rank}", 1)

    def beats(self, rank: int) -> int:
        return self.store.add(f"hb/{rank}", 0)
