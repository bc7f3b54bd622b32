"""Shared by the collection tests: kill a whole `hybridrl train` job with SIGKILL once a checkpoint is
complete, and check from the run's own `groups.jsonl` that every drawn prompt was trained exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.launch import ROOT, env_with_repo, kill_tree, processes_mentioning


def kill_after_checkpoint(recipe, overrides: list[str], run_dir: Path, step: int, timeout_s: float = 300) -> dict:
    """Run the job until checkpoint `step` is complete, SIGKILL every process of it; returns that
    checkpoint's trainer state."""
    agent = subprocess.Popen([sys.executable, "-m", "hybridrl", "train", str(recipe), *overrides], cwd=ROOT,
                             env=env_with_repo(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    marker = run_dir / "checkpoints" / f"step_{step:06d}" / "COMPLETE"
    deadline = time.monotonic() + timeout_s
    while not marker.exists() and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), f"the run never completed its step-{step} checkpoint"
    for p in processes_mentioning(str(run_dir)):
        p.send_signal(signal.SIGKILL)
    kill_tree(agent.pid)
    agent.wait(timeout=30)
    return json.loads((marker.parent / "trainer_state.json").read_text())


def assert_every_drawn_prompt_trained_once(run_dir: Path, steps: int, held: set[str]) -> None:
    """From groups.jsonl: nothing drawn or trained twice, every drawn prompt trained or still in flight
    at the end, and what the checkpoint held in flight came back after the resume."""
    rows = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    task = lambda g: g.split("@")[0]  # noqa: E731
    drawn = [t for r in rows for t in r["drawn"]]
    returned = [task(g) for r in rows for g in r["returned"]]
    assert len(drawn) == len(set(drawn))                                  # nothing drawn twice
    assert len(returned) == len(set(returned))                            # nothing trained twice
    assert sorted(returned + [task(g) for g in rows[-1]["in_flight"]]) == sorted(drawn)
    assert {task(g) for g in held} <= set(returned) | {task(g) for g in rows[-1]["in_flight"]}
