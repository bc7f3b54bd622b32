"""What the entry points set in the environment before torch allocates or multiplies anything: host
tensors on transparent huge pages, and MKL's code path on AMD processors with AVX-512.

Huge pages.

PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation, and with it puts
allocations of 2 MiB and more on huge pages: memory released between modes (gradient buffers, the
KV cache) is then faulted back in 2 MiB pages instead of 4 KiB ones, so re-creating a buffer runs
near copy speed (measurements: docs/publication.md). When training and rollout
processes share a host's CPUs side by side (roles apart), faulting memory in at the same time with
huge pages slows them down more than without, so those runs keep small pages.

A value the user set is kept; `HYBRIDRL_THP_DEFAULT=1` marks a value set here (not by the user), so
that a later entry point in the same process tree may still choose for its placement.
"""

from __future__ import annotations

import os

_OURS = "HYBRIDRL_THP_DEFAULT"


def choose_pages(*, roles_apart: bool = False) -> None:
    """Huge pages for host tensors unless the user chose, or training and generation run side by side."""
    if "THP_MEM_ALLOC_ENABLE" in os.environ and os.environ.get(_OURS) != "1":
        return
    os.environ["THP_MEM_ALLOC_ENABLE"] = "0" if roles_apart else "1"
    os.environ[_OURS] = "1"


# MKL picks its code path by vendor: on an AMD processor with AVX-512 it runs the matrix products of few
# rows (a decode step: one row per running sequence) on a slower one unless told otherwise. Measured on
# a 2-core AMD EPYC (AVX-512, torch 2.13's MKL 2024.2), one linear layer of 4864 x 896 float32: 8 rows
# 1.64-2.40 ms -> 1.10-1.30 ms, 16 rows 2.10 -> 1.57 ms; a training-sized product (600 rows, forward and
# backward) unchanged; `benchmarks/generation.py` at ~100M parameters, batch 16: the native engine 115 ->
# 162 tokens/s, medians of 4 alternating runs (docs/native-engine.md). MKL_CBWR pins the path (its conditional numerical
# reproducibility: the same bits run to run on that path). Read at MKL's first call.
_MKL_PATH = "AVX512"


def cpu_flags() -> tuple[str, set[str]]:
    """(vendor id, flags) of this machine's first processor, from /proc/cpuinfo (Linux; else empty)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read(1 << 16)        # the first processor's block is a few KiB
    except OSError:
        return "", set()
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("vendor_id", ""), set(fields.get("flags", "").split())


def choose_blas_path() -> None:
    """MKL's AVX-512 path on an AMD processor that has AVX-512, unless the user set MKL_CBWR."""
    if "MKL_CBWR" in os.environ:
        return
    vendor, flags = cpu_flags()
    if vendor == "AuthenticAMD" and "avx512f" in flags:
        os.environ["MKL_CBWR"] = _MKL_PATH
