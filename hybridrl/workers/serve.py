"""`serve()`: what every rank but the controller runs, from start-up to shutdown.

Wait for the next command, receive this rank's share of the data, run the registered method,
post a status (and the output's header), send an owned output Batch to the controller. A
method that raises is reported at once (so the controller's watchdog sees it even while rank 0
is blocked in a collective) and in the status; the run is then aborted by the controller.
"""

from __future__ import annotations

import logging
import time
import traceback

from hybridrl.distributed.messages import SHUTDOWN, Command, Status
from hybridrl.data.batch import Batch
from hybridrl.distributed.bootstrap import DistContext
from hybridrl.distributed.control import ControlMessageError, ErrorReport, encode
from hybridrl.distributed.transport import BatchHeader, broadcast_batch, recv_batch, send_batch
from hybridrl.distributed.watchdog import EXIT_ABORTED, Watchdog
from hybridrl.workers.base import Worker

log = logging.getLogger(__name__)

_MAX_POLL_S = 0.05
_ABORT_CHECK_S = 0.5


def serve(worker: Worker, ctx: DistContext, watchdog: Watchdog) -> int:
    """Run commands until SHUTDOWN (returns 0) or an abort (returns EXIT_ABORTED)."""
    control = ctx.control
    seq = 0
    while True:
        seq += 1
        watchdog.idle_in_serve = True
        cmd = _next_command(control, seq)
        watchdog.idle_in_serve = False
        if cmd is None:
            return EXIT_ABORTED
        if cmd.method == SHUTDOWN:
            control.post_status(seq, Status(ok=True))
            return 0
        _run(worker, ctx, cmd)


def _next_command(control, seq: int) -> Command | None:
    """Poll for command `seq` (1 ms, backing off to 50 ms); None once the run is aborted."""
    backoff, next_abort_check = 0.001, time.monotonic() + _ABORT_CHECK_S
    while True:
        cmd = control.try_command(seq)
        if cmd is not None:
            return cmd
        if time.monotonic() > next_abort_check:
            if control.aborted() is not None:
                return None
            next_abort_check = time.monotonic() + _ABORT_CHECK_S
        time.sleep(backoff)
        backoff = min(backoff * 2, _MAX_POLL_S)


def _run(worker: Worker, ctx: DistContext, cmd: Command) -> None:
    rank = ctx.rank
    try:
        data = _receive(ctx, cmd)
        output = worker.invoke(cmd.method, data, cmd.kwargs)
        status = _status_for(output, rank in cmd.owners)   # raises if the output holds tensors
    except Exception as err:  # noqa: BLE001 - every failure is reported to the controller
        report = ErrorReport(rank, cmd.method, "exception", f"{type(err).__name__}: {err}",
                             traceback.format_exc(), time.time())
        ctx.control.report_error(report)
        ctx.control.post_status(cmd.seq, Status(ok=False, error=report))
        return
    ctx.control.post_status(cmd.seq, status)
    if status.output_kind == "batch":
        send_batch(output, 0, ctx.data_peers, ctx.device).wait()


def _receive(ctx: DistContext, cmd: Command) -> Batch | None:
    if cmd.same is not None:
        return broadcast_batch(None, cmd.same, 0, ctx.data_peers, ctx.device)
    header = cmd.per_rank.get(ctx.rank)
    if header is not None:
        return recv_batch(header, 0, ctx.data_peers, ctx.device)
    return None


def _status_for(output, owner: bool) -> Status:
    if not owner or output is None:
        return Status(ok=True)
    if isinstance(output, Batch):
        return Status(ok=True, output_kind="batch", header=BatchHeader.of(output))
    status = Status(ok=True, output_kind="object", value=output)
    try:
        encode(status)
    except ControlMessageError as err:
        raise ControlMessageError(f"{err}; return tensors in a Batch") from None
    return status
