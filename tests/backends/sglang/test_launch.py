"""SGLang's scheduler processes rendezvous over `tcp://` (sglang/srt/distributed/bootstrap.py); under
torchrun they would inherit TORCHELASTIC_USE_AGENT_STORE=True, with which torch's tcp rendezvous only
connects to a store that nobody hosts. Real torch, in real child processes: with the environment
`launch.child_environment` gives them the rendezvous completes; with torchrun's, it times out."""

from __future__ import annotations

import os
import subprocess
import sys

from hybridrl.backends.sglang import launch
from tests.launch import ROOT, free_port

RENDEZVOUS = """
import datetime, sys, torch.distributed as dist
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=float(sys.argv[2])))
dist.barrier()
print("rendezvous ok")
"""


def rendezvous(env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", RENDEZVOUS, str(free_port()), str(timeout_s)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_the_children_environment_lets_a_tcp_rendezvous_host_its_store():
    torchrun_rank = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    child = launch.child_environment(torchrun_rank)
    assert "TORCHELASTIC_USE_AGENT_STORE" not in child and child["TORCHELASTIC_RESTART_COUNT"] == "0"
    ok = rendezvous(child, 120)
    assert ok.returncode == 0 and "rendezvous ok" in ok.stdout, ok.stderr[-2000:]
    hung = rendezvous(torchrun_rank, 3)                    # what the schedulers did: wait for a store
    assert hung.returncode != 0 and "rendezvous ok" not in hung.stdout
    assert "timeout" in hung.stderr.lower() or "timed out" in hung.stderr.lower(), hung.stderr[-2000:]
