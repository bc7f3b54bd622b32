"""`hybridrl plot` and `hybridrl compare` on run directories laid out as runs write them (config.json
from the loader, metrics.jsonl through the run's MetricsLogger): the PNG opened and looked at
(size, not blank, the panels' colours present), the comparison's config diff and metric table."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from hybridrl.config import load_config
from hybridrl.config.loader import to_dict
from hybridrl.telemetry.metrics import MetricsLogger
from tests.launch import ROOT, env_with_repo

GRPO = ROOT / "recipes" / "calc_grpo_cpu.yaml"


def hybridrl(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", *map(str, args)], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=300)


def make_run(path, overrides, *, lift: float):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(to_dict(load_config(GRPO, [f"run.dir={path}", *overrides]))))
    logger = MetricsLogger(path, tensorboard=False)
    for step in range(0, 11):
        row = {"time/T_rollout": 1.0 + 0.1 * step, "time/T_train": 0.5, "time/T_sync": 0.2, "time/step_s": 1.8}
        if step:
            row.update({"reward/mean": lift * (1 - math.exp(-step / 3)), "kl": 0.01 * step,
                        "train/entropy": 1.5 - 0.05 * step, "loss": 0.1 / step})
        if step % 5 == 0:
            row["val/accuracy"] = lift * step / 10
        logger.log(step, row)
    logger.close()
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    return (make_run(base / "a", ["train.lr=5e-5"], lift=0.9),
            make_run(base / "b", ["train.lr=1e-4", "trainer.group_size=4"], lift=0.6))


def test_plot_writes_a_png_of_the_expected_size_with_curves(runs, tmp_path):
    out = tmp_path / "curves.png"
    proc = hybridrl("plot", *runs, "--out", out, "--width", "1200")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}"
    import matplotlib.image as mpimg
    import numpy as np

    image = mpimg.imread(out)                      # [H, W, 4] floats in [0, 1]
    height, width = image.shape[:2]
    assert width == 1200 and height == 3 * 320     # 5 metric panels + 2 stage-time panels: 3 rows of 3.2 in
    rgb = image[..., :3]
    assert (rgb.std() > 0.05) and (rgb < 0.9).mean() > 0.02        # not blank: lines, text, bars
    blue, orange = np.array([0.12, 0.47, 0.71]), np.array([1.0, 0.5, 0.05])   # matplotlib's first two colours
    for colour in (blue, orange):
        assert (np.abs(rgb - colour).max(axis=-1) < 0.08).sum() > 200
    one = hybridrl("plot", runs[0])                 # default: RUN/curves.png
    assert one.returncode == 0 and (runs[0] / "curves.png").stat().st_size > 10_000


def test_plot_of_a_directory_without_metrics_is_one_line(tmp_path):
    proc = hybridrl("plot", tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"hybridrl plot: {tmp_path}: no metrics.jsonl rows (a run directory: run.dir of a run)"]


def test_compare_shows_the_config_diff_and_a_metric_table(runs):
    proc = hybridrl("compare", *runs)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    # the keys a run derives from its own run.dir (audit log, kill switch, environments' database) are no difference
    assert "config: 2 key(s) differ:" in text and "audit_log" not in text and "run.dir" not in text
    assert "train.lr" in text and "A 5e-05  B 0.0001" in text
    assert "trainer.group_size" in text and "A 8  B 4" in text
    line = next(x for x in text.splitlines() if x.strip().startswith("val/accuracy"))
    assert "0 -> 0.9 (step 10)" in line and "0 -> 0.6 (step 10)" in line
    assert any(x.strip().startswith("reward/mean") for x in text.splitlines())
    missing = hybridrl("compare", runs[0], runs[0].parent / "nope")
    assert missing.returncode == 2 and "no config.json" in missing.stderr
