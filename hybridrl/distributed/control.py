"""The control plane: small pickled messages through the rendezvous key-value store.

Commands, per-rank outcomes, error reports, heartbeats and the abort flag live here. They are
small by construction: `encode` refuses any torch.Tensor, so bulk data can only move over the
data plane (`transport.py`).

Nothing here polls. A rank that waits for a key (a worker for the next command, the controller
for the end of a call) blocks in the store's own wait, which the store server answers the moment
the key is set, and every way a call can end sets the key its waiters wait on: the last worker to
finish, a worker that fails, the controller's watchdog (a dead or silent rank, a deadline), and
an abort, which writes an abort marker into the next command slots. (A world of one has no
worker to finish last: its controller posts no command and waits for no end; see `WorkerGroup`.)
A rank whose main thread is blocked elsewhere (inside a method, a collective) is reached by its
watchdog, which polls the abort flag once per heartbeat. A call costs the controller the same few store requests whatever the
world size (post the command; wait for the end of the call; read the owners' statuses at once),
and each worker two (read the command, a blocking get; count itself finished), plus a status and
its removal where the controller collects its output; see docs/multinode.md for the figures.

The main thread's connection waits as long as it takes (`connect`): only the waits above block,
on keys that some rank always sets, and the watchdog (its own connection, with a finite timeout)
ends the process if the run is over in any other way.

Keys (under the `hybridrl/` prefix):
  seq                  the number of the controller's newest command
  cmd/<seq>            the controller's command number <seq>, read by every worker
  status/<seq>/<rank>  the outcome of command <seq> on a rank whose output is collected, or that failed
  done                 finished (command, worker) pairs: the worker that makes it seq*(N-1) is the last of <seq>
  wake/<seq>           the end of command <seq>: b"done" (its last worker), b"fail:<rank>" (a failing
                       worker), b"fail" (the controller's watchdog)
  errors, error/<i>    counter and reports of failures, in the order they happened
  hb/<rank>            b"<beats> <newest command finished>" of a rank, set by its watchdog
  proc/<rank>          (hostname, pid) of a rank: what node it is on, and a fast death check on one host
  abort                set once: every rank exits
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

ABORT_MARKER = b"\x00hybridrl-abort"   # written into command slots by an abort (never a valid pickle)
FOREVER = timedelta(days=365)          # waits that some rank always ends (see the module doc)
DONE = "done"


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

    @classmethod
    def connect(cls, job_store: dist.Store, rank: int, world_size: int) -> "ControlPlane":
        """The control plane on a connection of its own to the job's store, under `hybridrl/`,
        whose waits never time out (see the module doc)."""
        store = dist.PrefixStore("hybridrl/", job_store).clone()
        store.set_timeout(FOREVER)
        return cls(store, rank, world_size)

    def clone(self) -> "ControlPlane":
        return ControlPlane(self.store.clone(), self.rank, self.world_size)

    # commands (controller -> every worker) -------------------------------------------------

    def post_command(self, seq: int, command: Any) -> None:
        """`command` may be pre-encoded bytes. One request: the command and the newest number."""
        payload = command if isinstance(command, bytes) else encode(command)
        self.store.multi_set([f"cmd/{seq}", "seq"], [payload, str(seq).encode()])

    def wait_command(self, seq: int) -> Any | None:
        """Block until command `seq` is posted; None if the run was aborted instead."""
        data = self.store.get(f"cmd/{seq}")     # the connection's timeout: FOREVER (`connect`)
        return None if data == ABORT_MARKER else decode(data)

    # the end of a call (every worker -> the controller) -------------------------------------

    def complete(self, seq: int, status: bytes | None = None) -> None:
        """This worker finished command `seq`; `status` (encoded) when the controller collects it.
        The last worker to finish wakes the controller and drops the previous command's keys. A job
        with one worker needs no count: its status and the wake-up go in one request (the status
        first, so the controller, woken, finds it)."""
        if self.world_size == 2:
            keys, values = [f"wake/{seq}"], [DONE.encode()]
            if status is not None:
                keys, values = [f"status/{seq}/{self.rank}", *keys], [status, *values]
            self.store.multi_set(keys, values)
        else:
            if status is not None:
                self.store.set(f"status/{seq}/{self.rank}", status)
            if self.store.add(DONE, 1) != seq * (self.world_size - 1):
                return
            self.store.set(f"wake/{seq}", DONE.encode())
        for key in (f"cmd/{seq - 1}", f"wake/{seq - 1}"):
            self._delete(key)

    def fail(self, seq: int, status: bytes) -> None:
        """This worker failed command `seq`: its status, then the controller woken at once."""
        self.store.set(f"status/{seq}/{self.rank}", status)
        self.wake(seq, f"fail:{self.rank}")

    def wake(self, seq: int, outcome: str = "fail") -> None:
        self.store.set(f"wake/{seq}", outcome.encode())

    def wait_outcome(self, seq: int, timeout: timedelta = FOREVER) -> str:
        """Block until command `seq` is over: "done", "fail:<rank>" or "fail" (see `wake`).
        Raises torch.distributed.DistStoreError after `timeout`."""
        key = f"wake/{seq}"
        if timeout != FOREVER:
            self.store.wait([key], timeout)
        return self.store.get(key).decode()

    def statuses(self, seq: int, ranks: Sequence[int]) -> list[Any]:
        """The statuses those ranks posted for `seq` (one request)."""
        if not ranks:
            return []
        return [decode(v) for v in self.store.multi_get([f"status/{seq}/{r}" for r in ranks])]

    def status(self, seq: int, rank: int) -> Any:
        return decode(self.store.get(f"status/{seq}/{rank}"))

    def drop_status(self, seq: int) -> None:
        """A worker drops the status it posted for `seq` (once the controller has read it)."""
        self._delete(f"status/{seq}/{self.rank}")

    def _delete(self, key: str) -> None:
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
        """Set the abort flag (busy ranks' watchdogs see it) and write the abort marker into the
        next two command slots, which wakes every worker waiting for a command (the controller may
        be posting the next one at this moment: a worker that still gets it ends in that call)."""
        self.store.set("abort", reason.encode())
        newest = self.store.add("seq", 0)
        for seq in (newest + 1, newest + 2):
            self.store.set(f"cmd/{seq}", ABORT_MARKER)

    def aborted(self) -> str | None:
        if self.store.check(["abort"]):
            return self.store.get("abort").decode()
        return None

    # liveness ---------------------------------------------------------------------------------

    def register_process(self, hostname: str, pid: int) -> None:
        self.beat(0, 0)                            # the heartbeat key exists from now on
        self.store.set(f"proc/{self.rank}", encode((hostname, pid)))

    def registered(self, ranks: Sequence[int]) -> list[int]:
        """Those of `ranks` that have registered their process."""
        return [r for r in ranks if self.store.check([f"proc/{r}"])]

    def process(self, rank: int) -> tuple[str, int] | None:
        key = f"proc/{rank}"
        return decode(self.store.get(key)) if self.store.check([key]) else None

    def processes(self, ranks: Sequence[int]) -> dict[int, tuple[str, int]]:
        """(hostname, pid) of registered ranks (one request)."""
        if not ranks:
            return {}
        return {r: decode(v) for r, v in zip(ranks, self.store.multi_get([f"proc/{r}" for r in ranks]))}

    def beat(self, count: int, finished: int) -> None:
        """Heartbeat number `count`, with the newest command this rank finished."""
        self.store.set(f"hb/{self.rank}", f"{count} {finished}".encode())

    def beats(self, rank: int) -> tuple[int, int]:
        """(heartbeats, newest command finished) of a registered rank."""
        return _beat(self.store.get(f"hb/{rank}"))

    def beats_of(self, ranks: Sequence[int]) -> list[tuple[int, int]]:
        """`beats` of registered ranks (one request)."""
        if not ranks:
            return []
        return [_beat(v) for v in self.store.multi_get([f"hb/{r}" for r in ranks])]


def _beat(value: bytes) -> tuple[int, int]:
    count, finished = value.split()
    return int(count), int(finished)
