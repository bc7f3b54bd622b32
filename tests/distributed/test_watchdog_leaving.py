"""A worker that acknowledged SHUTDOWN outlives its controller (hybridrl/workers/serve.py): the controller exits
as soon as every rank acknowledged, and a worker still tearing down must not take that exit for the
controller's death (it did: rank 1 then exited 1 and torchrun called a finished run failed). Real processes: the
worker's watchdog runs in a child process whose 'controller' is another process that exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.launch import ROOT, env_with_repo

WORKER = textwrap.dedent("""
    import os, subprocess, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from hybridrl.distributed.config import DistributedConfig
    from hybridrl.distributed.control import ControlPlane
    from hybridrl.distributed.watchdog import Watchdog

    leaving = sys.argv[1] == "leaving"
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
    controller = ControlPlane.connect(client, 0, 2)
    worker = ControlPlane.connect(client, 1, 2)
    rank0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])   # the controller process
    controller.register_process(os.uname().nodename, rank0.pid)
    worker.register_process(os.uname().nodename, os.getpid())
    controller.beat(1, 0)
    watchdog = Watchdog(worker, DistributedConfig(device="cpu", heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0,
                                                 error_grace_s=1.0))
    watchdog.leaving = leaving                     # what serve() sets when it acknowledges SHUTDOWN
    watchdog.start()
    time.sleep(0.3)                                # the watchdog has seen the controller alive
    rank0.wait()                                   # the controller exits
    time.sleep(1.5)                                # the worker's teardown: many watchdog rounds
    print("tore down")
""")


def _worker(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WORKER, mode], cwd=ROOT, env=env_with_repo(), capture_output=True,
                          text=True, timeout=120)


def test_a_worker_that_acknowledged_shutdown_outlives_its_controller():
    proc = _worker("leaving")
    assert proc.returncode == 0 and "tore down" in proc.stdout, proc.stderr[-2000:]


def test_a_worker_still_serving_stops_when_its_controller_dies():
    proc = _worker("serving")
    assert proc.returncode == 1 and "tore down" not in proc.stdout, proc.stdout
    assert "the controller (rank 0, pid" in proc.stderr and "died" in proc.stderr, proc.stderr[-2000:]
