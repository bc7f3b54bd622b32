"""The first-contact script (benchmarks/gpu_first_contact.py) on CPU: its sequence, its report, its bounds.
The whole sequence with the GPU check kit's CPU run is slow (~2 minutes: the kit's own CPU run is
tests/bench/test_gpu_check.py); the default suite runs every other stage for real."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from tests.launch import ROOT, env_with_repo

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_first_contact  # noqa: E402

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null", "PIP_FIND_LINKS": ""}


def first_contact(tmp_path, *args, timeout=300):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_first_contact.py", "--out", str(tmp_path), *args], cwd=ROOT,
                          env=env_with_repo(OFFLINE), capture_output=True, text=True, timeout=timeout)
    return proc, json.loads((tmp_path / "first_contact.json").read_text())


def test_the_cpu_sequence_records_each_stage_with_its_time_and_why_gpu_ones_skip(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    proc, report = first_contact(tmp_path, "--device", "cpu", "--venv", sys.prefix, "--wheelhouse", str(wheelhouse),
                                 "--only", "environment,versions,gpu_tests,sglang,vllm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == ["environment", "versions", "gpu_tests", "sglang", "vllm"]
    assert report["ok"] and report["device"] == "cpu"
    env = stages["environment"]["detail"]
    assert env["how"].startswith(f"reused the venv {sys.prefix}") and env["installed"] == []     # offline
    assert stages["gpu_tests"]["command"][0] == env["python"]                                 # the stages run in it
    info = stages["versions"]["detail"]
    assert stages["versions"]["status"] == "passed" and info["torch"] and info["cuda_available"] is False
    assert info["gpus"] == [] and "nvidia_smi" in info
    tests = stages["gpu_tests"]
    assert tests["status"] == "passed" and tests["returncode"] == 0 and 0 < tests["seconds"] <= tests["bound_s"]
    assert tests["detail"]["skipped"] > 0 and tests["detail"]["passed"] == tests["detail"]["failed"] == 0
    assert all("CUDA GPU" in reason for reason in tests["detail"]["skip_reasons"]), tests["detail"]
    assert "tests/backends/native/test_gpu.py" in tests["command"]
    assert stages["vllm"]["status"] == "skipped" and "CUDA only" in stages["vllm"]["reason"]
    assert stages["sglang"]["status"] in ("skipped", "passed")
    assert "first contact: ok" in proc.stdout


def test_a_stage_past_its_bound_is_killed_with_everything_it_started(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    code, seconds = gpu_first_contact.run_bounded(["sh", "-c", script], 3.0, tmp_path / "log")
    assert code is None and 3.0 <= seconds < 60
    child = int(pidfile.read_text())
    # SIGKILL is delivered asynchronously: on a loaded machine the orphan may take a moment to die
    for _ in range(300):
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the stage's child outlived its kill by 30 s")


def test_the_budget_leaves_no_stage_running_past_it(tmp_path):
    proc, report = first_contact(tmp_path, "--device", "cpu", "--budget-s", "4", "--only", "gpu_tests,gpu_check")
    stages = {s["name"]: s for s in report["stages"]}
    assert {s["status"] for s in stages.values()} == {"skipped"}
    assert all(s["reason"] == "no time left in --budget-s" for s in stages.values())
    assert proc.returncode == 1 and not report["ok"]


def test_unknown_stages_are_named():
    with pytest.raises(SystemExit):
        gpu_first_contact.main(["--device", "cpu", "--only", "gpu_test"])


@pytest.mark.slow
def test_the_whole_sequence_runs_on_cpu_offline(tmp_path):
    """`make gpu-first-contact FIRST_CONTACT_ARGS=--dry-run`: every stage, the kit's CPU run included, offline."""
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    proc, report = first_contact(tmp_path / "out", "--dry-run", "--venv", sys.prefix, "--wheelhouse", str(wheelhouse),
                                 timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == list(gpu_first_contact.BOUNDS_S) and report["seconds"] <= report["budget_s"]
    check = stages["gpu_check"]
    assert check["status"] == "passed" and check["detail"]["ok"] and check["detail"]["device"] == "cpu"
    assert check["detail"]["budget_s"] < check["bound_s"]
    assert check["detail"]["environment"]["how"].startswith(f"reused the venv {sys.prefix}")
