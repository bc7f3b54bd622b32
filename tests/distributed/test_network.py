"""distributed.socket_ifname: the interface gloo, NCCL's bootstrap and the store's address use.
An interface this host lacks stops the run before anything starts, naming what the host has
(`hybridrl train`, and every rank of a torchrun / srun launch). Its use across two hosts:
tests/test_slurm_2node.py."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from hybridrl.cli import main
from hybridrl.distributed.network import InterfaceError, bind_interface, host_address, interface_address
from tests.launch import ROOT, env_with_repo

GRPO = str(ROOT / "recipes" / "calc_grpo_cpu.yaml")


def loopback() -> str:
    return next(name for name, addrs in psutil.net_if_addrs().items()
                if any(a.address == "127.0.0.1" for a in addrs))


def test_an_interface_gives_its_address_and_a_missing_one_names_those_there_are():
    assert interface_address(loopback()) == "127.0.0.1"
    with pytest.raises(InterfaceError) as err:
        interface_address("nosuch0")
    assert str(err.value).startswith("distributed.socket_ifname=nosuch0: no such interface on ")
    assert loopback() in str(err.value)
    assert host_address().count(".") == 3


def test_binding_sets_gloo_and_nccl_but_keeps_a_sites_nccl_setting(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    bind_interface("")                                              # unset: nothing chosen
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    bind_interface(loopback())
    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback()
    assert os.environ["NCCL_SOCKET_IFNAME"] == loopback()
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    bind_interface(loopback())
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    with pytest.raises(InterfaceError):
        bind_interface("nosuch0")


def test_a_missing_interface_stops_the_launch_and_every_rank_before_they_start(tmp_path, capsys):
    code = main(["train", GRPO, "--check", "distributed.socket_ifname=nosuch0", f"run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("hybridrl: distributed.socket_ifname=nosuch0: no such interface on ") and loopback() in err
    rank = subprocess.run([sys.executable, "-m", "hybridrl.train", "--config", GRPO, "distributed.socket_ifname=nosuch0",
                           f"run.dir={tmp_path}"], cwd=ROOT, env=env_with_repo(), capture_output=True, text=True,
                          timeout=120)
    assert rank.returncode == 2 and rank.stderr.strip().splitlines() == [err], rank.stderr


def test_the_address_command_prints_what_a_node_would_use():
    run = [sys.executable, "-m", "hybridrl.distributed.network", "address"]
    ok = subprocess.run([*run, loopback()], env=env_with_repo(), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.strip() == "127.0.0.1"
    bad = subprocess.run([*run, "nosuch0"], env=env_with_repo(), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no such interface" in bad.stderr
