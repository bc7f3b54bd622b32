from __future__ import annotations

import math
import time

import torch

from hybridrl.telemetry.metrics import MetricsLogger, read_metrics
from hybridrl.telemetry.timers import PeakMemory, StageTimer


def test_metrics_jsonl_and_tensorboard(tmp_path):
    log = MetricsLogger(tmp_path)
    log.log(1, {"reward/mean": 0.5, "loss": float("nan")})
    log.log(2, {"reward/mean": 0.75, "val/accuracy": 0.3})
    log.close()
    rows = read_metrics(tmp_path)
    assert rows == [{"step": 1, "loss": None, "reward/mean": 0.5},
                    {"step": 2, "reward/mean": 0.75, "val/accuracy": 0.3}]
    assert any((tmp_path / "tensorboard").iterdir())
    # resuming from step 1 drops the rows after it
    MetricsLogger(tmp_path, tensorboard=False, resume_from_step=1).close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]


def test_stage_timer_and_peak_rss():
    timer = StageTimer()
    with timer("a"):
        time.sleep(0.02)
    with timer("a"):
        time.sleep(0.01)
    totals = timer.pop()
    assert totals["a"] >= 0.03 and timer.pop() == {}
    with PeakMemory() as base:
        pass
    with PeakMemory() as probe:
        x = torch.ones(64 * 2**20 // 4)   # 64 MiB touched
        time.sleep(0.05)
        del x
    assert probe.peak_bytes - base.peak_bytes > 32 * 2**20
    assert not math.isnan(probe.peak_bytes)


def test_peak_rss_of_a_forked_child_is_its_own():
    """The probe keeps /proc files open per process: a child forked after the parent used them reads
    its own peak, not the parent's (whose 256 MiB it never touched)."""
    import os

    with PeakMemory():
        x = torch.ones(256 * 2**20 // 4)
        del x
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: report its own peak and leave at once
        with PeakMemory() as child:
            pass
        os.write(write, str(child.peak_bytes).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    child_peak = int(os.read(read, 64))
    with open(f"/proc/{os.getpid()}/status") as f:
        parent_hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    assert 0 < child_peak < parent_hwm - 128 * 2**20
