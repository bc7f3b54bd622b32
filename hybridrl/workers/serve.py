"""`serve()`: what every rank but the controller runs, from start-up to shutdown.

Wait for the next command (a blocking wait on the store: the command arrives the moment the
controller posts it, and an abort wakes the wait), receive this rank's share of the data, run the
registered method, report the outcome (with the output's header when the controller collects
it), send an owned output Batch to the controller. A method that raises is reported at once (so
the controller's watchdog sees it even while rank 0 is blocked in a collective) and wakes the
controller; the run is then aborted by the controller.
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


def serve(worker: Worker, ctx: DistContext, watchdog: Watchdog) -> int:
    """Run commands until SHUTDOWN (returns 0) or an abort (returns EXIT_ABORTED)."""
    control = ctx.control
    seq, posted_before = 0, False
    while True:
        seq += 1
        watchdog.idle_in_serve = True
        cmd = control.wait_command(seq)
        watchdog.idle_in_serve = False
        if cmd is None:
            return EXIT_ABORTED
        if cmd.method == SHUTDOWN:
            watchdog.leaving = True        # first: once acknowledged, the controller's exit is no failure
            control.complete(seq)
            return 0
        posted = _run(worker, ctx, cmd)
        if posted_before:                  # read by the controller before it posted `seq`
            control.drop_status(seq - 1)
        posted_before = posted
        watchdog.finished = seq


def _run(worker: Worker, ctx: DistContext, cmd: Command) -> bool:
    """Run one command and report its outcome; True if a status key was posted."""
    rank = ctx.rank
    try:
        data = _receive(ctx, cmd)
        output = worker.invoke(cmd.method, data, cmd.kwargs)
        status = _status_for(output, rank in cmd.owners)
        message = _encoded(status) if status is not None else None   # raises if the output holds tensors
    except Exception as err:  # noqa: BLE001 - every failure is reported to the controller
        report = ErrorReport(rank, cmd.method, "exception", f"{type(err).__name__}: {err}",
                             traceback.format_exc(), time.time())
        ctx.control.report_error(report)
        ctx.control.fail(cmd.seq, encode(Status(ok=False, error=report)))
        return True
    ctx.control.complete(cmd.seq, message)
    if status is not None and status.output_kind == "batch":
        send_batch(output, 0, ctx.data_peers, ctx.device).wait()
    return message is not None


def _receive(ctx: DistContext, cmd: Command) -> Batch | None:
    if cmd.same is not None:
        return broadcast_batch(None, cmd.same, 0, ctx.data_peers, ctx.device)
    header = cmd.per_rank.get(ctx.rank)
    if header is not None:
        return recv_batch(header, 0, ctx.data_peers, ctx.device)
    return None


def _status_for(output, owner: bool) -> Status | None:
    """What the controller collects of this rank's output (None: nothing, the call just finished)."""
    if not owner:
        return None
    if output is None:
        return Status(ok=True)
    if isinstance(output, Batch):
        return Status(ok=True, output_kind="batch", header=BatchHeader.of(output))
    return Status(ok=True, output_kind="object", value=output)


def _encoded(status: Status) -> bytes:
    try:
        return encode(status)
    except ControlMessageError as err:
        raise ControlMessageError(f"{err}; return tensors in a Batch") from None
