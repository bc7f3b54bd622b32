"""`WorkerGroup`: the controller's handle on every rank's worker (single controller, SPMD workers).

`call(method, data, dispatch=...)` posts one command to every rank, ships each rank its share of
the data over the data plane, runs the method on rank 0 too, then collects the outputs of the
ranks that own them. A failure anywhere (a rank raising, a rank dying, a call past its timeout)
becomes one `WorkerGroupError` naming the rank, the method and the remote traceback; the group
then aborts, and every rank exits.

Batches that come back are put on the controller's device (the CPU: the controller filters,
lays out and logs on the host) whichever device a rank's output or the data plane used, so
that rank 0's own output and the others' concatenate (on a GPU node the data plane receives on
`cuda:0` while rank 0's output may be on the CPU).
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridrl.distributed.dispatch import Dispatch, Plan
from hybridrl.distributed.messages import SHUTDOWN, Command, Status
from hybridrl.data.batch import Batch
from hybridrl.distributed.bootstrap import DistContext
from hybridrl.distributed.control import DONE, ErrorReport, encode
from hybridrl.distributed.mesh import Mesh
from hybridrl.distributed.transport import BatchHeader, PendingSends, broadcast_batch, recv_batch, send_batch
from hybridrl.distributed.watchdog import Watchdog
from hybridrl.workers.base import Worker

log = logging.getLogger(__name__)

CONTROLLER_DEVICE = torch.device("cpu")


def to_controller(output: Any, device: torch.device = CONTROLLER_DEVICE) -> Any:
    """A collected output on the controller's device: a Batch moved there, anything else as it is."""
    if isinstance(output, Batch) and any(t.device != device for t in output.tensors.values()):
        return output.to(device)
    return output


class WorkerGroupError(RuntimeError):
    """A call failed on some rank. `str()` names the rank, the method and the remote traceback."""

    def __init__(self, report: ErrorReport):
        self.report = report
        self.rank = report.rank
        self.method = report.method
        self.remote_traceback = report.traceback
        super().__init__(format_report(report))


def format_report(report: ErrorReport) -> str:
    if report.kind == "timeout":
        head = report.message
    else:
        head = f"rank {report.rank} failed in '{report.method}': {report.message}"
    if report.traceback:
        return f"{head}\n--- traceback from rank {report.rank} ---\n{report.traceback.rstrip()}"
    return head


class WorkerGroup:
    def __init__(self, worker: Worker, ctx: DistContext, watchdog: Watchdog):
        if not ctx.is_controller:
            raise RuntimeError("a WorkerGroup lives on rank 0; other ranks run serve()")
        self.worker = worker
        self.ctx = ctx
        self.watchdog = watchdog
        self._seq = 0
        self._broken: WorkerGroupError | None = None
        self._closed = False

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def _workers(self) -> bool:
        """Whether any rank but this one takes part. A world of one (a single-rank job) has none:
        a call is rank 0's alone, with no command to post and no end to wait for (the end of a call
        is set by its last worker to finish; with none, nobody would set it)."""
        return self.world_size > 1

    def mesh(self, name: str) -> Mesh:
        meshes = self.worker.meshes()
        if name not in meshes:
            raise KeyError(f"{type(self.worker).__name__} has no mesh '{name}' (has: {sorted(meshes)})")
        return meshes[name]

    # ------------------------------------------------------------------ calls

    def call(self, method: Callable[..., Any], data: Batch | None = None, *, dispatch: Dispatch | None = None,
             timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run a registered worker method on the ranks its dispatch mode names; see module doc."""
        if self._broken is not None:
            raise WorkerGroupError(self._broken.report)
        if self._closed:
            raise RuntimeError("the worker group is shut down")
        spec = type(self.worker).method_spec(method)
        dispatch = dispatch or spec.dispatch
        timeout = timeout_s or spec.timeout_s or self.ctx.cfg.call_timeout_s
        plan = dispatch.plan(data, self)
        if 0 in plan.owners and not self.worker.holds(spec.name):
            raise TypeError(f"{spec.name}: rank 0 is to answer it, but its placement gave it no such part "
                            f"(it holds {[type(p).__name__ for p in self.worker.parts]})")
        if not dispatch.runs_everywhere:
            return plan.gather({0: to_controller(self._run_local(spec.name, plan.same, kwargs, peers=False))})

        seq = self._seq + 1
        cmd = Command(seq, spec.name, dict(kwargs),
                      same=BatchHeader.of(plan.same) if plan.same is not None else None,
                      per_rank={r: BatchHeader.of(b) for r, b in plan.per_rank.items() if r != 0},
                      owners=tuple(plan.owners))
        message = encode(cmd)   # a tensor in kwargs fails here, before anything is sent
        self._seq = seq
        self._begin(seq, spec.name, timeout)
        if self._workers:
            self.ctx.control.post_command(seq, message)
        try:
            with self._blocked():
                data0 = self._send(plan)
                output0 = self._run_local(spec.name, data0, kwargs, peers=self._workers)
            statuses = self._wait_statuses(seq, [r for r in plan.owners if r != 0])
            with self._blocked():
                outputs = self._receive(statuses, plan.owners)
            if 0 in plan.owners:
                outputs[0] = output0
            return plan.gather({rank: to_controller(out) for rank, out in outputs.items()})
        except WorkerGroupError as err:
            self._fail(err)
            raise
        except BaseException as err:
            report = self._root_cause(err) or ErrorReport(0, spec.name, "exception", _describe(err),
                                                          traceback.format_exc())
            failure = WorkerGroupError(report)
            self._fail(failure)
            raise failure from err
        finally:
            self.watchdog.deadline = None
            self.watchdog.call_seq = None

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Tell every worker to return from serve(); wait for them to acknowledge."""
        if self._closed or self._broken is not None:
            return
        self._closed = True
        if not self._workers:
            return
        self._seq += 1
        self.watchdog.call_seq = self._seq
        self.ctx.control.post_command(self._seq, Command(self._seq, SHUTDOWN))
        try:
            outcome = self.ctx.control.wait_outcome(self._seq, timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            outcome = "timeout"
        finally:
            self.watchdog.call_seq = None
        if outcome != DONE:
            log.warning("workers did not acknowledge shutdown within %.0fs (%s)", timeout_s, outcome)

    def abort(self, reason: str) -> None:
        self._closed = True
        self.ctx.control.abort(reason)

    # ------------------------------------------------------------------ internals

    @contextlib.contextmanager
    def _blocked(self):
        self.watchdog.blocked = True
        try:
            yield
        finally:
            self.watchdog.blocked = False

    def _send(self, plan: Plan) -> Batch | None:
        ctx = self.ctx
        if plan.same is not None:
            return broadcast_batch(plan.same, BatchHeader.of(plan.same), 0, ctx.data_peers, ctx.device)
        pending = PendingSends()
        for rank, batch in plan.per_rank.items():
            if rank != 0:
                send_batch(batch, rank, ctx.data_peers, ctx.device, pending)
        pending.wait()
        return plan.per_rank.get(0)

    def _run_local(self, name: str, data: Batch | None, kwargs: dict[str, Any], peers: bool = True) -> Any:
        try:
            return self.worker.invoke(name, data, kwargs)
        except Exception as err:
            report = ErrorReport(0, name, "exception", _describe(err), traceback.format_exc(), time.time())
            # With peers in the call, rank 0's error may be the echo of another rank's failure
            # (a collective broken by a dead peer): prefer the root cause the watchdog finds.
            root = self._root_cause(err) if peers else None
            raise WorkerGroupError(root or report) from err

    def _begin(self, seq: int, method: str, timeout: float) -> None:
        """Tell the watchdog which call is in flight: it ends the wait for it on any failure."""
        self.watchdog.method = method
        self.watchdog.deadline = time.time() + timeout
        self.watchdog.timeout_s = timeout
        self.watchdog.call_seq = seq

    def _wait_statuses(self, seq: int, owners: list[int]) -> dict[int, Status]:
        """Wait for call `seq` to end on every worker (a blocking wait on the store: the last worker
        to finish, a failing worker or the watchdog ends it); the statuses of the owners."""
        control = self.ctx.control
        failure = self.watchdog.poll_failure()
        if failure is not None:
            raise WorkerGroupError(failure)
        if not self._workers:
            return {}
        outcome = control.wait_outcome(seq)
        if outcome == DONE:
            return dict(zip(owners, control.statuses(seq, owners)))
        failure = self.watchdog.poll_failure()
        if outcome.startswith("fail:") and (failure is None or failure.kind == "exception"):
            failure = control.status(seq, int(outcome.split(":", 1)[1])).error
        raise WorkerGroupError(failure or self.watchdog.wait_failure(self.ctx.cfg.heartbeat_interval_s * 3)
                               or ErrorReport(0, self.watchdog.method, "exception", f"call {seq} ended: {outcome}"))

    def _receive(self, statuses: dict[int, Status], owners: list[int]) -> dict[int, Any]:
        outputs: dict[int, Any] = {}
        for rank in owners:
            if rank == 0:
                continue
            status = statuses[rank]
            if status.output_kind == "batch":
                outputs[rank] = recv_batch(status.header, rank, self.ctx.data_peers, self.ctx.device)
            else:
                outputs[rank] = status.value
        return outputs

    def _root_cause(self, err: BaseException) -> ErrorReport | None:
        """A failure the watchdog found on another rank (e.g. the peer that broke a collective).
        A peer lost on another host is found by its silence, so a communication error waits up to
        the heartbeat timeout for it; anything else a few heartbeats."""
        cfg = self.ctx.cfg
        wait_s = cfg.heartbeat_interval_s * 3
        if _peer_loss(err) and len(self.watchdog.nodes()) > 1:
            wait_s = cfg.heartbeat_timeout_s + 2 * cfg.heartbeat_interval_s
        return self.watchdog.wait_failure(wait_s)

    def _fail(self, err: WorkerGroupError) -> None:
        if self._broken is None:
            self._broken = err
            self.abort(str(err))


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout", "NCCL")


def _peer_loss(err: BaseException) -> bool:
    """Whether an error looks like a collective or transfer broken by a peer that went away."""
    return isinstance(err, dist.DistError) or any(s in str(err) for s in _PEER_LOSS)
