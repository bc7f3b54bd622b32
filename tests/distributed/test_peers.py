"""`Peers` chooses its collectives' device by the group's backend (CPU for gloo, the current CUDA
device for NCCL), so callers that pass no device work on both: two real ranks over gloo, and the
same ranks over a group that refuses CPU tensors as NCCL does (tests/distributed/peers_jobs.py)."""

from __future__ import annotations

import json

import torch

from hybridrl.distributed import peers
from tests.launch import run_torchrun


class _Named:
    def __init__(self, name):
        self._name = name

    def name(self):
        return self._name


def test_collective_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert peers.collective_device(_Named("nccl")) == torch.device("cuda", 3)
    assert peers.collective_device(_Named("gloo")) == torch.device("cpu")
    assert peers.collective_device(object()) == torch.device("cpu")
    assert peers.Peers(_Named("gloo"), [0, 1], 0, device="cuda:1").device == torch.device("cuda", 1)


def test_peers_over_gloo_and_over_a_group_that_refuses_cpu_tensors(tmp_path):
    out = tmp_path / "peers.json"
    proc = run_torchrun(["--standalone", "--nproc-per-node=2", "-m", "tests.distributed.peers_jobs", str(out)],
                        timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["gloo_device"] == "cpu" and r["gloo_object"] == {"from": 1, "spec": [1, 2]}
    assert r["nccl_device"] == "lazy:0"
    assert r["nccl_object"] == {"weights": "spec", "n": 3}
    assert r["nccl_all_reduce"] == {"values": [2.0, 0.0], "device": "cpu"}      # staged, back in the CPU tensor
    assert r["nccl_broadcast"] == [0, 2, 4, 6]
    assert r["nccl_devices_seen"] == ["lazy"]                                  # no CPU tensor reached the group
    assert "Tensors must be CUDA" in r["cpu_buffers"]                           # the old default: refused
