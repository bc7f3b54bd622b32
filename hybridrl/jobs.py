"""Jobs: what every rank runs under `hybridrl.train` (a worker class + the controller's loop), and the
`run` section that names one.

`run.job` names a shipped job (the rows below: their code is imported when the job runs) or any
"package.module:ATTR" that is a `Job`, so experiments live in their own modules and the core never
branches on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hybridrl.config.fields import ConfigError, ConfigValueError, check_choice, knob
from hybridrl.registry import Lazy, Registry

if TYPE_CHECKING:
    from hybridrl.controller.worker_group import WorkerGroup
    from hybridrl.distributed.bootstrap import DistContext
    from hybridrl.workers.base import Worker


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
    owns_run_dir: bool = False     # keeps run.json, checkpoints and resumes in run.dir (store/rundir.py)
    needs_model: bool = False      # refused without model.path
    colocated_only: bool = False   # refused under a placement with the training and rollout ranks apart


JOBS: Registry[Job] = Registry("job", key="run.job", row=Job)
for _row in (
    Job("selfcheck", Lazy("hybridrl.workers.selfcheck:SelfCheckWorker"), Lazy("hybridrl.workers.selfcheck:run_selfcheck"),
        colocated_only=True),
    Job("rl", Lazy("hybridrl.controller.placements:make_worker"), Lazy("hybridrl.controller.trainer:train"),
        owns_run_dir=True, needs_model=True),
    Job("sft", Lazy("hybridrl.controller.sft:SFTWorker"), Lazy("hybridrl.controller.sft:run_sft"),
        owns_run_dir=True, needs_model=True, colocated_only=True),
):
    JOBS.register(_row)


def resolve_job(name: str) -> Job:
    return JOBS.get(name)


def owns_run_dir(name: str) -> bool:
    """Whether `run.job` keeps its run directory (a job of your own is imported to tell: a ConfigError
    naming `run.job` when that fails)."""
    try:
        return JOBS.get(name).owns_run_dir
    except ConfigValueError as err:
        raise ConfigError(str(err), key=err.field) from None


@dataclass(kw_only=True)
class RunConfig:
    """What this run is and where it writes."""

    name: str = knob("run", "run name; also the default run directory's leaf")
    dir: str = knob("runs/${run.name}", "run directory: logs, metrics.jsonl, checkpoints")
    job: str = knob("selfcheck", f"what the ranks run: one of {JOBS.names()} or 'package.module:JOB'")
    seed: int = knob(0, "global seed: data order, sampling, init")
    log_level: str = knob("info", "debug | info | warning | error")

    def __post_init__(self) -> None:
        JOBS.check("job", self.job, load=False)
        check_choice("log_level", self.log_level, ("debug", "info", "warning", "error"))

    @property
    def needs_model(self) -> bool:
        """A shipped job that trains a model (a job of your own is not imported to tell)."""
        return JOBS.known(self.job) and JOBS.get(self.job).needs_model

    @property
    def colocated_only(self) -> bool:
        """A shipped job that runs colocated only (a job of your own is not imported to tell)."""
        return JOBS.known(self.job) and JOBS.get(self.job).colocated_only
