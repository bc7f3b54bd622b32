"""The torchrun entry point: bootstrap every rank, then rank 0 drives and the others serve.

    torchrun --nproc-per-node N -m hybridrl.train --config recipes/X.yaml [key=value ...]

The config is loaded and validated, and the run's inputs checked (`hybridrl.preflight`: model
files, the task, what happens to run.dir), before any process group starts: a bad recipe or a
missing input exits with code 2 and one line naming it. Exit codes: 0 done, 1 the run failed (every rank exits),
2 bad configuration; after SIGINT / SIGTERM (`hybridrl/controller/interrupts.py`) 0 under torchrun's agent, else 128 +
the signal. When torchrun restarts the ranks (`trainer.max_restarts`), an RL run resumes
from its newest complete checkpoint (TORCHELASTIC_RESTART_COUNT > 0 forces `trainer.resume=auto`).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
import traceback
from typing import Sequence

from hybridrl.controller import interrupts
from hybridrl.config import ConfigError, load_config
from hybridrl.host_memory import choose_blas_path, choose_pages
from hybridrl.telemetry.logs import setup_logging

log = logging.getLogger("hybridrl.train")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="recipe YAML (without it: the defaults and the overrides)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run(cfg) -> int:
    """Run `cfg.run.job` on this rank; returns the process exit code."""
    from hybridrl.controller.worker_group import WorkerGroup, WorkerGroupError, format_report
    from hybridrl.distributed.bootstrap import init_distributed, shutdown_distributed
    from hybridrl.distributed.control import ErrorReport
    from hybridrl.distributed.watchdog import Watchdog
    from hybridrl.jobs import JobStopped, RunFailed, resolve_job
    from hybridrl.workers.serve import serve

    job = resolve_job(cfg.run.job)
    ctx = init_distributed(cfg.distributed, cfg.placement)
    setup_logging(cfg.run.log_level, ctx.rank)
    watchdog = Watchdog(ctx.control, cfg.distributed, format_failure=format_report)
    watchdog.start()
    interrupts.attach(ctx, watchdog)         # rank 0 can now stop every rank on SIGINT / SIGTERM
    seed_everything(cfg.run.seed)
    code = EXIT_OK
    try:
        worker = job.make_worker(cfg, ctx)
    except Exception as err:
        report = ErrorReport(ctx.rank, f"{job.name}: worker start-up", "exception",
                             f"{type(err).__name__}: {err}", traceback.format_exc(), time.time())
        ctx.control.report_error(report)
        if ctx.is_controller:
            ctx.control.abort(format_report(report))
        print(f"hybridrl: {format_report(report)}", file=sys.stderr)
        _exit_now(EXIT_FAILED)
    if ctx.is_controller:
        group = WorkerGroup(worker, ctx, watchdog)
        try:
            job.controller(cfg, group)
            group.shutdown()
        except JobStopped as stopped:       # stopped cleanly, resumable: the workers were closed
            log.warning("%s", stopped)
            group.shutdown()
        except WorkerGroupError as err:
            print(f"hybridrl: run failed: {err}", file=sys.stderr)
            code = EXIT_FAILED
        except RunFailed as err:            # the run's own verdict: every rank stops, the reason is the message
            group.abort(str(err))
            print(f"hybridrl: run failed: {err}", file=sys.stderr)
            code = EXIT_FAILED
        except BaseException as err:  # the controller's own bug, or Ctrl-C
            group.abort(f"the controller failed: {type(err).__name__}: {err}")
            traceback.print_exc()
            code = EXIT_FAILED
    else:
        code = serve(worker, ctx, watchdog)
    watchdog.stop()
    interrupts.detach()   # no thread of ours left inside a store call when the store goes
    if code != EXIT_OK:
        _exit_now(code)   # peers may be gone: tearing down process groups could block
    shutdown_distributed()
    return code


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _restart_resume(cfg) -> str:
    """torchrun restarted the ranks (trainer.max_restarts): continue from the newest complete
    checkpoint; without one, start over (the failed attempt moves to <run.dir>.old-N)."""
    from hybridrl.store.checkpoints import CheckpointManager

    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    how = "auto" if CheckpointManager(cfg.run.dir).latest() is not None else "never"
    if os.environ.get("RANK", "0") == "0":
        print(f"hybridrl: restart {restart} of at most {cfg.trainer.max_restarts}: trainer.resume={how}",
              file=sys.stderr)
    return how


def main(argv: Sequence[str] | None = None) -> int:
    from hybridrl.store import rundir
    from hybridrl.preflight import PreflightError, preflight

    interrupts.install(int(os.environ.get("RANK", "0")))    # before anything starts a process or a thread
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.run.job == "rl" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            cfg = load_config(args.config, [*args.overrides, f"trainer.resume={_restart_resume(cfg)}"])
        preflight(cfg)            # every rank, before the process group: a bad input stops them all
    except (ConfigError, PreflightError) as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_CONFIG
    rundir.record_origin(args.config, args.overrides)
    interrupts.configure(cfg)
    choose_pages(roles_apart=cfg.placement.disaggregated)      # before torch allocates anything
    choose_blas_path()                                          # before its first matrix product
    return run(cfg)


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(main)            # exits with main's status, without the interpreter's teardown
