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
