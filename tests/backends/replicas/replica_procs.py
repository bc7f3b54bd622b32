"""Replica processes for the tests: `hybridrl replica` started for real, found through its registration."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from hybridrl.backends.replicas.handoff import registrations
from tests.launch import ROOT, env_with_repo


@dataclass
class ReplicaProc:
    proc: subprocess.Popen
    log: Path
    registry: Path

    def registration(self) -> dict | None:
        for path in registrations(self.registry):
            entry = json.loads(path.read_text())
            if entry["pid"] == self.proc.pid:
                return entry
        return None

    def wait_registered(self, timeout: float = 180.0) -> dict:
        """Its registration, once written (it listens by then); fails at once if the process died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.registration()
            if entry is not None:
                return entry
            if self.proc.poll() is not None:
                raise AssertionError(f"the replica exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"the replica did not register in {timeout:.0f} s:\n{self.log.read_text()[-4000:]}")

    def info(self) -> dict:
        return httpx.get(f"{self.wait_registered()['url']}/info", timeout=10, trust_env=False).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_replica(model: Path, registry: Path, log: Path, *args: str, kv_cache_mb: int = 8) -> ReplicaProc:
    cmd = [sys.executable, "-m", "hybridrl", "replica", "--model", str(model), "--registry", str(registry), *args,
           f"rollout.native.kv_cache_mb={kv_cache_mb}"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=out, stderr=subprocess.STDOUT)
    return ReplicaProc(proc, log, registry)
