"""Jobs: what every rank runs under `hybridrl.train` (a worker class + the controller's loop).

`run.job` names a shipped job or any "package.module:ATTR" that is a `Job`, so experiments
live in their own modules and the core never branches on them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from hybridrl.controller.worker_group import WorkerGroup
    from hybridrl.distributed.bootstrap import DistContext
    from hybridrl.workers.base import Worker

SHIPPED = {
    "selfcheck": "hybridrl.workers.selfcheck:JOB",
    "rl": "hybridrl.controller.trainer:JOB",
    "sft": "hybridrl.controller.sft:JOB",
}


class JobStopped(Exception):
    """The job stopped cleanly before its end and can resume (e.g. a kill switch was set): every rank
    exits 0 and the run is not marked finished."""


class RunFailed(Exception):
    """The run cannot go on (e.g. every episode of several steps in a row failed): every rank exits 1 and
    the reason is printed, without a traceback."""


@dataclass(frozen=True)
class Job:
    name: str
    make_worker: Callable[[Any, "DistContext"], "Worker"]     # (config, ctx) -> worker, on every rank
    controller: Callable[[Any, "WorkerGroup"], Any]           # (config, group) -> result, on rank 0


def resolve_job(name: str) -> Job:
    target = SHIPPED.get(name, name)
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"run.job={name!r}: not a shipped job ({sorted(SHIPPED)}) nor 'module:ATTR'")
    job = getattr(importlib.import_module(module_name), attr)
    if not isinstance(job, Job):
        raise TypeError(f"run.job={name!r} resolves to a {type(job).__name__}, not a hybridrl.jobs.Job")
    return job
