"""The kill switch on a real RL run (torchrun, 2 CPU ranks): set while the run is going, it stops
the run after a step's rollout without training on it, leaves the run resumable, and the resumed
run (after --clear) is bitwise the uninterrupted one."""

from __future__ import annotations

import json
import threading
import time

import pytest

from hybridrl.agent import killswitch
from hybridrl.store import rundir
from hybridrl.telemetry.audit import records, verify
from hybridrl.telemetry.metrics import read_metrics
from tests.controller.conftest import STRAIGHT, rl_model, straight_run  # noqa: F401  (fixtures)
from tests.controller.test_rl_e2e import RECIPE, assert_same_run, hybridrl_train


def _trip_after_checkpoint(run_dir, step: int, done: threading.Event) -> None:
    """Set the switch once checkpoint `step` is complete (what an operator watching the run does)."""
    marker = run_dir / "checkpoints" / f"step_{step:06d}" / "COMPLETE"
    while not done.is_set():
        if marker.exists():
            killswitch.trip(run_dir / "kill-switch", "test: the operator stops the run",
                            audit_log=str(run_dir / "audit.jsonl"))
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_the_kill_switch_stops_a_run_cleanly_and_it_resumes_bitwise(tmp_path, rl_model, straight_run):  # noqa: F811
    run_dir = tmp_path / "run"
    args = [f"model.path={rl_model}", *STRAIGHT, f"run.dir={run_dir}"]
    done = threading.Event()
    watcher = threading.Thread(target=_trip_after_checkpoint, args=(run_dir, 2, done), daemon=True)
    watcher.start()
    try:
        proc = hybridrl_train(RECIPE, *args)
    finally:
        done.set()
    assert proc.returncode == 0, proc.stderr[-4000:]
    stopped = [line for line in proc.stdout.splitlines() if "stopped by the kill switch at step" in line]
    assert stopped, proc.stdout[-3000:]
    step = int(stopped[0].split("at step ")[1].split()[0])
    assert step in (3, 4)                                  # after the checkpoint of step 2
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(step))     # the stopped step: not trained
    assert rundir.read_record(run_dir).get("status") != "finished"
    kinds = [r["kind"] for r in records(run_dir / "audit.jsonl")]
    assert "kill_switch_set" in kinds and "run_stopped" in kinds and verify(run_dir / "audit.jsonl")[0]

    assert killswitch.clear(run_dir / "kill-switch")
    proc = hybridrl_train(RECIPE, *args, "trainer.resume=auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resuming from" in proc.stderr and "step_000002" in proc.stderr
    assert_same_run(straight_run, run_dir)
    assert json.loads((run_dir / "config.json").read_text())["tools"]["kill_switch"] == str(run_dir / "kill-switch")
