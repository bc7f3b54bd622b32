"""MKL's code path: pinned to AVX-512 on an AMD processor that has it (MKL would pick a slower one for the
products of few rows), left alone elsewhere and whenever the user set MKL_CBWR."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybridrl import host_memory
from tests.launch import ROOT, env_with_repo


@pytest.mark.parametrize("vendor, flags, expected", [
    ("AuthenticAMD", {"avx2", "avx512f", "avx512_bf16"}, "AVX512"),
    ("AuthenticAMD", {"avx2", "fma"}, None),                 # no AVX-512: MKL's own choice
    ("GenuineIntel", {"avx2", "avx512f"}, None),             # MKL already takes AVX-512 there
    ("", set(), None),                                        # no /proc/cpuinfo
])
def test_the_path_is_pinned_only_on_amd_with_avx512(monkeypatch, vendor, flags, expected):
    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.setattr(host_memory, "cpu_flags", lambda: (vendor, flags))
    host_memory.choose_blas_path()
    assert os.environ.get("MKL_CBWR") == expected


def test_a_value_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    monkeypatch.setattr(host_memory, "cpu_flags", lambda: ("AuthenticAMD", {"avx512f"}))
    host_memory.choose_blas_path()
    assert os.environ["MKL_CBWR"] == "COMPATIBLE"


def test_this_machine_is_read_and_the_cli_passes_its_choice_to_what_it_starts():
    vendor, flags = host_memory.cpu_flags()
    if sys.platform.startswith("linux"):
        assert vendor and flags
    env = {k: v for k, v in env_with_repo().items() if k != "MKL_CBWR"}
    # an in-process command of the CLI; what it set is in the environment its children inherit
    probe = ("import os, sys; from hybridrl.cli import main; sys.argv=['hybridrl']; "
             "main(['init', 'recipe', '--list']); print('MKL_CBWR=' + os.environ.get('MKL_CBWR', ''))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    chosen = "AVX512" if vendor == "AuthenticAMD" and "avx512f" in flags else ""
    assert out.stdout.strip().splitlines()[-1] == f"MKL_CBWR={chosen}"
