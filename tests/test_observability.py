"""Observability of a real run (2 CPU ranks, the tiny recipe), one run shared by every check: the
Prometheus port scraped while it lives, the timeline of its ranks and engines (`inspect --timeline`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.inspect.test_timeline import check_trace
from tests.launch import ROOT, env_with_repo, free_port

RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"
STEPS = 4


def scrape(port: int) -> dict[str, float]:
    """One scrape of the metrics port: sample name (with labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, tiny_models):
    """The run, and every scrape that reached its port while it ran."""
    model = tiny_models("qwen2", init_std=0.05)
    run_dir = tmp_path_factory.mktemp("observed")
    port = free_port()
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), f"model.path={model}", f"run.dir={run_dir}",
           f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2", "trainer.export_hf=false",
           f"trainer.metrics_port={port}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    scrapes: list[dict[str, float]] = []

    def poll():
        while proc.poll() is None:
            try:
                scrapes.append(scrape(port))
            except OSError:                   # not serving yet, or no more
                time.sleep(0.005)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=600)
    watcher.join(timeout=10)
    assert proc.returncode == 0, err[-4000:]
    return run_dir, scrapes


def test_the_metrics_port_serves_the_advancing_step_while_the_run_lives(observed_run):
    run_dir, scrapes = observed_run
    steps = [s["hybridrl_step"] for s in scrapes]
    assert len(set(steps)) >= 2, f"the step never advanced in {len(scrapes)} scrapes: {sorted(set(steps))}"
    assert steps == sorted(steps) and max(steps) <= STEPS
    counted = [s["hybridrl_steps_total"] for s in scrapes]
    assert counted == sorted(counted) and len(set(counted)) >= 2
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for s in scrapes:                          # each scrape's scalars are its step's row in metrics.jsonl
        step = int(s["hybridrl_step"])
        if step > 0 and "hybridrl_reward_mean" in s:
            assert s["hybridrl_reward_mean"] == pytest.approx(rows[step]["reward/mean"])
            assert s["hybridrl_tokens_generated"] == rows[step]["tokens/generated"]
        phases = {k for k, v in s.items() if k.startswith("hybridrl_phase{") and v == 1.0}
        assert len(phases) == 1, phases         # one stage at a time
    seen = {k for s in scrapes for k, v in s.items() if k.startswith("hybridrl_phase{") and v == 1.0}
    assert len(seen) >= 2, seen


def test_the_timeline_has_every_rank_and_engine_and_its_steps(observed_run):
    run_dir, _ = observed_run
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "inspect", str(run_dir), "--timeline"], cwd=ROOT,
                          env=env_with_repo(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((run_dir / "timeline.json").read_text())
    threads = check_trace(trace)
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["engine 0 (episodes)", "engine 1 (episodes)", "rank 0", "rank 1"]
    controller = [e for e in threads[(0, 1)]]
    steps = [e for e in controller if e["name"] == "step"]
    assert [e["args"]["step"] for e in steps] == list(range(1, STEPS + 1))
    names = {e["name"] for e in controller}
    assert {"sync", "rollout", "prep", "train", "store", "validate", "checkpoint"} <= names
    assert sum(e["name"] == "checkpoint" for e in controller) == 2          # steps 2 and 4
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for step in steps:                         # the controller's stages inside a step add up to its metrics
        inside = [e for e in controller if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        train = sum(e["dur"] for e in inside if e["name"] == "train") / 1e6
        assert train == pytest.approx(rows[step["args"]["step"]]["time/T_train"], rel=0.05, abs=2e-3)
    for rank in (0, 1):                         # every rank: its switch phases, generation and train passes
        phases = {e["name"] for e in threads[(rank, 2)]}
        assert {"offload", "wake", "generate", "sleep", "reload", "train"} <= phases, phases
    episodes = [e for (pid, _), es in threads.items() if pid >= 1000 for e in es if e["name"] == "episode"]
    assert len(episodes) == sum(r["episodes"] for s, r in rows.items() if s > 0)
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"
