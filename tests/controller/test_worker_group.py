"""The worker group with real ranks over gloo: dispatch/collect, errors, deaths, timeouts, shutdown.

Ranks are started bare (the torchrun environment, no elastic agent) so that it is our own
failure handling that ends the run, not torchrun's agent."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from tests.launch import ROOT, launch_bare, processes_mentioning

RECIPE = ROOT / "recipes" / "selfcheck.yaml"
BOUND_S = 40  # every failing run must be over (all ranks gone) well within this


def run_scenario(tmp_path, job: str, world: int = 2, extra=(), during=None, timeout=90):
    run_dir = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    overrides = [f"run.job=tests.controller.scenarios:{job}", f"run.dir={run_dir}",
                 "distributed.heartbeat_timeout_s=5", "distributed.error_grace_s=1", *extra]
    launch = launch_bare(world, RECIPE, overrides, timeout=timeout, during=during)
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    leftovers = processes_mentioning(str(run_dir))
    assert not leftovers, f"orphan processes: {[p.pid for p in leftovers]}"
    return launch, result


@pytest.mark.parametrize("world", [1, 2, 3])
def test_dp_split_uneven_and_collect(tmp_path, world):
    # world 1: a single-rank job, whose controller is the only rank (no worker to end a call or
    # acknowledge the shutdown)
    launch, result = run_scenario(tmp_path, "UNEVEN", world=world)
    assert launch.codes == [0] * world, launch.all_stderr
    assert "did not acknowledge shutdown" not in launch.stderr(0)
    for n_str, r in result["uneven"].items():
        n = int(n_str)
        chunk = -(-n // world)
        assert r["ids"] == [f"s{i}" for i in range(n)]                 # order kept, padding stripped
        assert r["value"] == [10.0 * i for i in range(n)]
        assert r["rank"] == [i // chunk for i in range(n)]             # row i was computed by dp rank i//chunk
        assert r["num_padding"] == 0
        assert r["loss_mask_sum"] == [3.0] * n                         # real rows keep their mask
        # each rank was told how many of its chunk's rows were padding
        expected_pad = [max(0, (i // chunk + 1) * chunk - max(i // chunk * chunk, n)) for i in range(n)]
        assert r["padding_seen"] == expected_pad
    assert result["tp"] == {"ids": ["a", "b", "c"], "rank": [0, 0, 0]}  # only tp rank 0's output
    assert [e["rank"] for e in result["echo"]] == list(range(world))
    assert "bulk tensors travel in a Batch" in result["tensor_kwarg"]
    assert [e["value"] for e in result["echo_after"]] == [5] * world


def _assert_failed_fast(launch):
    assert all(c not in (0, None) for c in launch.codes), launch.all_stderr
    assert launch.seconds < BOUND_S, f"took {launch.seconds:.1f}s"


def test_rank_raising_names_rank_method_and_traceback(tmp_path):
    launch, result = run_scenario(tmp_path, "RAISE")
    _assert_failed_fast(launch)
    err = result["error"]
    assert err["rank"] == 1 and err["method"] == "ScenarioWorker.raise_on" and err["kind"] == "exception"
    assert "ValueError: boom from rank 1" in err["message"]
    assert "marker 7f3a" in err["traceback"] and "scenarios.py" in err["traceback"]
    assert "rank 1 failed in 'ScenarioWorker.raise_on'" in launch.stderr(0)


def test_controller_rank_raising(tmp_path):
    launch, result = run_scenario(tmp_path, "RAISE_ON_CONTROLLER")
    _assert_failed_fast(launch)
    assert result["error"]["rank"] == 0 and result["error"]["method"] == "ScenarioWorker.raise_on"


def test_rank_raising_while_others_wait_in_a_collective(tmp_path):
    # rank 0 is stuck inside all_reduce and cannot poll: the watchdog must report and end it
    launch, result = run_scenario(tmp_path, "RAISE_IN_COLLECTIVE")
    _assert_failed_fast(launch)
    assert "rank 1 failed in 'ScenarioWorker.raise_before_collective'" in launch.stderr(0)
    assert "marker c0ll" in launch.stderr(0)


def test_rank_killed(tmp_path):
    launch, result = run_scenario(tmp_path, "DIE")
    _assert_failed_fast(launch)
    assert launch.codes[1] == -9
    assert result["error"]["rank"] == 1 and result["error"]["kind"] in ("died", "silent")
    assert "rank 1" in launch.stderr(0)


def test_rank_killed_during_collective(tmp_path):
    launch, result = run_scenario(tmp_path, "DIE_IN_COLLECTIVE")
    _assert_failed_fast(launch)
    assert launch.codes[1] == -9
    assert "rank 1" in launch.stderr(0) and ("died" in launch.stderr(0) or "heartbeat" in launch.stderr(0))


def test_output_with_tensors_is_an_error_of_that_rank(tmp_path):
    launch, result = run_scenario(tmp_path, "TENSOR_OUTPUT")
    _assert_failed_fast(launch)
    assert result["error"]["rank"] == 1
    assert "return tensors in a Batch" in result["error"]["message"]


def test_call_timeout(tmp_path):
    started = time.monotonic()
    launch, result = run_scenario(tmp_path, "TIMEOUT")
    _assert_failed_fast(launch)
    assert result["error"]["kind"] == "timeout"
    assert "exceeded its 2s timeout" in result["error"]["message"] and "[1]" in result["error"]["message"]
    assert time.monotonic() - started < 30   # rank 1 was sleeping 60 s: it was stopped, not waited for


def test_controller_killed_workers_exit(tmp_path):
    launch, _ = run_scenario(tmp_path, "CONTROLLER_DIES", world=2)
    assert launch.codes[0] == -9
    assert launch.codes[1] not in (0, None), launch.all_stderr
    assert launch.seconds < BOUND_S


def test_clean_shutdown(tmp_path):
    launch, result = run_scenario(tmp_path, "CLEAN", world=2)
    assert launch.codes == [0, 0], launch.all_stderr
    assert result["echo"] == [{"rank": 0, "value": "hi"}, {"rank": 1, "value": "hi"}]
