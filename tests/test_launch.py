"""Launch paths with torchrun: `hybridrl train`, and two torchrun agents forming one job."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.launch import ROOT, env_with_repo, free_port, kill_tree

RECIPE = ROOT / "recipes" / "selfcheck.yaml"


def test_hybridrl_train_starts_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "train", str(RECIPE), f"run.dir={tmp_path}"],
                          cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "selfcheck.json").read_text())
    assert report["world_size"] == 2 and len({r["pid"] for r in report["ranks"]}) == 2
    assert "4 checks passed" in proc.stdout


def test_two_node_launch_on_one_machine(tmp_path):
    """Two torchrun agents (one process each) meet at a c10d rendezvous on 127.0.0.1."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-node-test",
           "--max-restarts", "0", "-m", "hybridrl.train", "--config", str(RECIPE), f"run.dir={tmp_path}",
           "distributed.nproc_per_node=1"]
    agents = [subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True) for _ in range(2)]
    try:
        outputs = [a.communicate(timeout=180) for a in agents]
    finally:
        for a in agents:
            kill_tree(a.pid)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[1][-3000:] for o in outputs)
    report = json.loads((tmp_path / "selfcheck.json").read_text())
    assert report["world_size"] == 2
    assert sorted(r["node_rank"] for r in report["ranks"]) == [0, 1]   # one rank under each agent
    assert report["checks"]["dispatch_dp_split_uneven"].startswith("ok")
