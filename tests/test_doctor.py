from __future__ import annotations

import json
import subprocess
import sys

from tests.launch import ROOT


def test_doctor_json_selftest():
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "doctor", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0, json.dumps(report.get("selftest"), indent=1)
    assert report["versions"]["torch"] and report["versions"]["megatron-core"]
    assert report["native_kernels"]["ok"], report["native_kernels"]       # this machine has a C compiler
    st = report["selftest"]
    assert st["ok"] and st["clean_run"]["ok"] and st["error_propagation"]["ok"]
    assert set(st["clean_run"]["checks"]) == {"dispatch_one_to_all", "dispatch_dp_split_uneven",
                                              "broadcast_and_collective", "rank0_only"}
