"""The control plane over a real TCPStore: blocking waits that the right event ends; and the whole
plane with real processes (the control-plane benchmark's ranks, four of them on two simulated
nodes, so that the second node's ranks are seen through their heartbeats only): a node lost.
Raising ranks, deaths on one host, timeouts and shutdown: tests/controller/test_worker_group.py."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from hybridrl.distributed.control import DONE, ControlPlane, encode
from hybridrl.distributed.messages import Command, Status
from tests.launch import ROOT, env_with_repo


@pytest.fixture
def planes():
    """A store server and a factory of control planes on their own connections (as bootstrap makes them)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))

    def make(rank: int, world_size: int) -> ControlPlane:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
        return ControlPlane.connect(client, rank, world_size)

    yield make
    del server


def waiting(fn):
    """Run fn() in a thread; returns (thread, box): box holds its result once it returns."""
    box = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    return thread, box


def test_a_worker_waits_for_its_command_and_an_abort_ends_the_wait(planes):
    controller, worker = planes(0, 2), planes(1, 2)
    thread, box = waiting(lambda: worker.wait_command(1))
    time.sleep(0.3)
    assert thread.is_alive()                                           # nothing posted: it waits
    controller.post_command(1, Command(1, "echo", {"x": 1}))
    thread.join(5)
    assert box and box[0].method == "echo" and box[0].kwargs == {"x": 1}
    thread, box = waiting(lambda: worker.wait_command(2))              # idle, waiting for the next one
    time.sleep(0.3)
    started = time.monotonic()
    planes(1, 2).abort("stop")                                          # any rank may abort
    thread.join(5)
    assert box == [None] and time.monotonic() - started < 2           # the abort reached the idle worker
    assert controller.aborted() == "stop"


def test_the_last_worker_ends_the_call_and_a_failing_one_ends_it_at_once(planes):
    controller = planes(0, 3)
    workers = [planes(1, 3), planes(2, 3)]
    controller.post_command(1, b"cmd")
    thread, box = waiting(lambda: controller.wait_outcome(1))
    workers[0].complete(1, b"status-of-1")
    time.sleep(0.3)
    assert not box                                                     # one worker still running
    workers[1].complete(1)
    thread.join(5)
    assert box == [DONE]
    assert controller.store.get("status/1/1") == b"status-of-1"
    controller.post_command(2, b"cmd")
    for w in workers:
        w.complete(2)
    assert controller.wait_outcome(2) == DONE
    assert not controller.store.check(["cmd/1"]) and not controller.store.check(["wake/1"])   # tidied by the last
    assert controller.store.check(["cmd/2"])
    controller.post_command(3, b"cmd")                                  # the third call: rank 2 fails
    thread, box = waiting(lambda: controller.wait_outcome(3))
    workers[1].fail(3, b"it failed")
    thread.join(5)
    assert box == ["fail:2"] and controller.store.get("status/3/2") == b"it failed"


def test_one_worker_ends_a_call_with_its_status_in_one_request(planes):
    """With one worker there is nothing to count: its status and the wake-up arrive together, the status
    readable the moment the controller wakes; the previous call's keys are tidied."""
    controller, worker = planes(0, 2), planes(1, 2)
    for seq in (1, 2, 3):
        controller.post_command(seq, b"cmd")
        owners = [1] if seq != 2 else []                      # call 2: the worker's output is not collected
        thread, box = waiting(lambda: (controller.wait_outcome(seq), controller.statuses(seq, owners)))
        time.sleep(0.05)
        worker.complete(seq, encode(Status(ok=True, output_kind="object", value={"seq": seq})) if seq != 2 else None)
        thread.join(5)
        if seq != 2:
            assert box == [(DONE, [Status(ok=True, output_kind="object", value={"seq": seq})])]
        else:
            assert box == [(DONE, [])] and not controller.store.check(["status/2/1"])
    assert not controller.store.check(["cmd/2", "wake/2"]) and controller.store.check(["cmd/3", "wake/3"])
    assert not controller.store.check(["done"])               # no count was kept


def test_the_watchdogs_wake_ends_a_wait_and_heartbeats_carry_progress(planes):
    controller, worker = planes(0, 2), planes(1, 2)
    worker.register_process("node-b", 4242)
    assert controller.registered([1]) == [1] and controller.processes([1]) == {1: ("node-b", 4242)}
    worker.beat(7, 3)
    assert controller.beats_of([1]) == [(7, 3)]
    thread, box = waiting(lambda: controller.wait_outcome(5))
    planes(0, 2).wake(5)                                               # what the watchdog does on a failure
    thread.join(5)
    assert box == ["fail"]
    with pytest.raises(dist.DistStoreError):
        controller.wait_outcome(6, timedelta(seconds=0.2))             # a bounded wait (shutdown's) gives up
    status = Status(ok=True, output_kind="object", value={"r": 1})
    worker.complete(1, encode(status))
    assert controller.statuses(1, [1]) == [status]


def run_plane(tmp_path, scenario: str, world: int = 4, per_node: int = 2, timeout: float = 3.0) -> dict:
    """The control-plane benchmark's ranks, once: `world` processes on nodes of `per_node`."""
    out = tmp_path / f"{scenario}.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "control_plane.py"), "--one", str(world),
                           "--scenario", scenario, "--out", str(out), "--calls", "3", "--warmup", "2", "--idle", "0.5",
                           "--ranks-per-node", str(per_node), "--heartbeat-timeout", str(timeout),
                           "--launch-timeout", "90"],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result.get("hung"), proc.stderr[-3000:]
    assert result["exit_codes_nonzero"] == world                       # every rank exited, none cleanly
    return result


def test_a_lost_node_is_named_with_its_ranks_and_every_rank_exits(tmp_path):
    result = run_plane(tmp_path, "kill")
    error = result["controller"]["error"]
    assert result["killed_ranks"] == [2, 3] and result["killed_node"] == "node1"
    assert "node node1 lost: ranks 2, 3 (every rank on it) sent no heartbeat" in error, error
    assert error.startswith("rank 2 failed in 'BenchWorker.busy'")
    assert result["dead_to_exit_s"] < 3.0 + 20                       # the heartbeat timeout, then the abort
