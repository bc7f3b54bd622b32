"""The demo (base model -> SFT -> GRPO with the calculator) with its GRPO rollouts on two replica processes,
one SIGKILLed early in the run and replaced: the run still learns what the demo learns (>= +25 points of
validation accuracy)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from hybridrl.demo import build_base_model
from tests.backends.replicas.replica_procs import start_replica
from tests.launch import ROOT, env_with_repo

KILL_AT = 200        # the doomed replica's 200th request: in the GRPO run's first steps (128 episodes a step)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_demo_learns_with_a_replica_killed_and_replaced(tmp_path):
    base = build_base_model(tmp_path / "base")
    registry = tmp_path / "registry"
    procs = [start_replica(base, registry, tmp_path / "a.log", kv_cache_mb=64),
             start_replica(base, registry, tmp_path / "b.log", "--kill-at-request", str(KILL_AT), kv_cache_mb=64)]
    try:
        for p in procs:
            p.wait_registered()
        cmd = [sys.executable, "-m", "hybridrl", "demo", "--dir", str(tmp_path / "demo"), "--base-model", base,
               "grpo:rollout.engine=replicas", f"grpo:rollout.replicas.registry={registry}",
               "grpo:rollout.replicas.min_live=2", "grpo:rollout.replicas.wait_s=300"]
        with (tmp_path / "demo.out").open("w") as out:
            run = subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=out, stderr=subprocess.STDOUT)
        procs[1].proc.wait(timeout=1500)
        procs.append(start_replica(base, registry, tmp_path / "c.log", kv_cache_mb=64))
        run.wait(timeout=1500)
        assert run.returncode == 0, (tmp_path / "demo.out").read_text()[-4000:]
        summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
        print(json.dumps({k: summary[k] for k in ("sft_accuracy", "final_accuracy", "improvement_points",
                                                  "seconds_this_run")}))
        assert procs[1].proc.returncode == -signal.SIGKILL
        assert "lost mid-request" in (tmp_path / "demo" / "grpo.log").read_text()
        assert procs[2].info()["served"] > 0
        assert summary["improvement_points"] >= 25, summary
    finally:
        for p in procs:
            p.stop()
