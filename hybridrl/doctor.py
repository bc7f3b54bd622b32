"""`hybridrl doctor`: versions, devices, and a real 2-rank self-test of the worker group.

The self-test launches `torchrun -m hybridrl.train` with the self-check recipe twice: once
clean (dispatch to all ranks, uneven data-parallel split and collect, broadcast + collective,
rank-0-only call) and once with a failure injected on the last rank, which must end the run
with an error naming that rank and method.

The GPU stack: the pinned sglang release (0.5.21) pulls a CUDA 13 stack (cuda-python>=13,
flashinfer and cutlass-dsl cu13 builds, nvshmem4py-cu13), which needs an NVIDIA driver of the r580
series or newer (CUDA 13.0 needs >= 580.65.06 on Linux: NVIDIA's CUDA 13.0 release notes, "CUDA
Toolkit and Corresponding Driver Versions"). `gpu_stack` reports the driver against that; with
sglang installed, an older driver is a problem found.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from hybridrl.distributed.process_exit import torchrun_command

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "selfcheck.yaml"
PACKAGES = ("torch", "megatron-core", "transformers", "tokenizers", "safetensors", "omegaconf", "numpy",
            "tensorboard", "sglang")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "hybridrl": None}
    for name in ("hybridrl",) + PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def devices() -> dict:
    import torch

    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
            "cuda": [], "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["cuda"].append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    return info


def native_kernels() -> dict:
    """Whether the native engine's C kernels build and load here (without them a CPU decode step runs torch
    operators: slower, the same numbers to float32 rounding)."""
    from hybridrl.backends.native import cpu_kernels

    try:
        built = cpu_kernels.load()
    except cpu_kernels.KernelUnavailable as exc:
        return {"ok": False, "problem": str(exc)}
    return {"ok": True, "path": str(built.path), "threaded": built.threaded}


SGLANG_MIN_DRIVER = (580, 65, 6)          # CUDA 13.0 on Linux, for sglang 0.5.21's CUDA 13 stack


def nvidia_driver() -> str | None:
    """The NVIDIA driver version nvidia-smi reports (None without a driver or nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return lines[0].strip() if lines else None


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def sglang_driver_problem(driver: str | None) -> str | None:
    """Why the SGLang backend cannot run on this driver (None: it can, as far as the driver goes)."""
    need = ".".join(f"{n:02d}" if i else str(n) for i, n in enumerate(SGLANG_MIN_DRIVER))
    if driver is None:
        return f"no NVIDIA driver found (nvidia-smi): the SGLang backend needs a GPU and driver >= {need} (CUDA 13)"
    if _version_tuple(driver) < SGLANG_MIN_DRIVER:
        return (f"NVIDIA driver {driver} is older than {need}: sglang 0.5.21 runs on CUDA 13, which needs "
                f"driver >= {need}; update the driver, or generate with rollout.engine=native")
    return None


def gpu_stack(sglang_version: str | None) -> dict:
    driver = nvidia_driver()
    problem = sglang_driver_problem(driver)
    return {"nvidia_driver": driver, "sglang": sglang_version, "problem": problem,
            "ok": problem is None or sglang_version is None}


def _launch(nproc: int, run_dir: Path, *overrides: str, timeout: float = 180) -> dict:
    cmd = torchrun_command(nproc, "-m", "hybridrl.train", "--config", str(RECIPE), f"run.dir={run_dir}",
                           f"distributed.nproc_per_node={nproc}", *overrides)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        code, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, err = None, (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    return {"exit_code": code, "stderr": err, "seconds": round(time.perf_counter() - started, 2)}


def selftest(nproc: int = 2) -> dict:
    with tempfile.TemporaryDirectory(prefix="hybridrl-doctor-") as tmp:
        clean = _launch(nproc, Path(tmp) / "clean")
        report_file = Path(tmp) / "clean" / "selfcheck.json"
        checks = json.loads(report_file.read_text())["checks"] if report_file.exists() else {}
        fail_rank = nproc - 1
        failed = _launch(nproc, Path(tmp) / "fail", f"selfcheck.fail_rank={fail_rank}")
    expected = f"rank {fail_rank} failed in 'SelfCheckWorker.fail_on'"
    result = {
        "nproc": nproc,
        "clean_run": {"ok": clean["exit_code"] == 0 and bool(checks), "exit_code": clean["exit_code"],
                      "seconds": clean["seconds"], "checks": checks},
        "error_propagation": {"ok": failed["exit_code"] == 1 and expected in failed["stderr"],
                              "exit_code": failed["exit_code"], "seconds": failed["seconds"],
                              "expected": expected},
    }
    if not result["clean_run"]["ok"]:
        result["clean_run"]["stderr_tail"] = clean["stderr"][-2000:]
    if not result["error_propagation"]["ok"]:
        result["error_propagation"]["stderr_tail"] = failed["stderr"][-2000:]
    result["ok"] = result["clean_run"]["ok"] and result["error_propagation"]["ok"]
    return result


def main(args) -> int:
    report = {"versions": versions(), "devices": devices(), "native_kernels": native_kernels()}
    report["gpu_stack"] = gpu_stack(report["versions"]["sglang"])
    if not args.no_selftest:
        report["selftest"] = selftest(args.nproc)
    ok = report.get("selftest", {}).get("ok", True) and report["gpu_stack"]["ok"]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if ok else 1
    print("hybridrl doctor")
    for name, version in report["versions"].items():
        print(f"  {name:14s} {version or '-'}")
    dev = report["devices"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in dev["cuda"]) or "none"
    print(f"  cpus           {dev['cpu_count']}   cuda: {gpus}")
    kernels = report["native_kernels"]
    print("  cpu kernels    " + (f"built: {kernels['path']}" if kernels["ok"] else
                                  f"note: unavailable ({kernels['problem']}); the native engine runs torch "
                                  "operators on the CPU (slower decoding)"))
    stack = report["gpu_stack"]
    print(f"  nvidia driver  {stack['nvidia_driver'] or '-'}"
          + (f"   {'PROBLEM' if not stack['ok'] else 'note'}: {stack['problem']}" if stack["problem"] else ""))
    if "selftest" in report:
        st = report["selftest"]
        print(f"self-test with {st['nproc']} ranks (torchrun, gloo):")
        for name, result in st["clean_run"]["checks"].items():
            print(f"  {name:28s} {result}")
        print(f"  {'clean run':28s} {'ok' if st['clean_run']['ok'] else 'FAILED'} ({st['clean_run']['seconds']}s)")
        ep = st["error_propagation"]
        print(f"  {'error propagation':28s} {'ok' if ep['ok'] else 'FAILED'} ({ep['seconds']}s): {ep['expected']}")
        for part in ("clean_run", "error_propagation"):
            if "stderr_tail" in st[part]:
                print(f"--- {part} stderr ---\n{st[part]['stderr_tail']}")
        print("doctor: all good" if ok else "doctor: PROBLEMS FOUND")
    return 0 if ok else 1
