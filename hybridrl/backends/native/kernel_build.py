"""Compiling the native engine's C kernels (`cpu_kernels.c`) into a shared library, cached on disk. No torch
here: the launcher's checks build the library before any rank starts (`hybridrl.preflight`), and the ranks
then find it in the cache; `cpu_kernels.py` loads it.

Build: `cc` (or `$CC`) with -O3, contraction into fused multiply-adds and the reassociation flags that let
reductions vectorise (not -ffast-math: its start-up code would make the whole process flush denormals to
zero), -march=native (-mcpu=native on Arm) where the compiler takes it, and OpenMP where it is available;
each of these is dropped in turn when the compiler refuses it, and a refused variant is remembered in the
cache (`.failed`), so later processes do not retry it. The library lands in `$HYBRIDRL_KERNEL_CACHE`
(default `$XDG_CACHE_HOME/hybridrl/kernels`, else `~/.cache/hybridrl/kernels`) under a name hashed from the
source, the compiler, the flags and the CPU's feature flags, so a cache shared between machines (a home
directory on a cluster) never hands one CPU's instructions to another. Concurrent builds (several ranks)
each write a file of their own and rename it into place. About 0.3 s with gcc.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math",
              "-fassociative-math", "-fno-signed-zeros")


class KernelUnavailable(RuntimeError):
    """The kernels could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    if os.environ.get("HYBRIDRL_KERNEL_CACHE"):
        return Path(os.environ["HYBRIDRL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridrl" / "kernels"


def _cpu_fingerprint() -> str:
    """The CPU's feature flags where Linux lists them, else the processor's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _arch_flags() -> tuple[str, ...]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i686"):
        return ("-march=native",)
    if machine in ("aarch64", "arm64"):
        return ("-mcpu=native",)
    return ()


def _compile(compiler: str, flags: tuple[str, ...], out: Path) -> str | None:
    """Compile SOURCE into `out`; the compiler's complaint, or None when it worked."""
    cmd = [compiler, *flags, str(SOURCE), "-o", str(out), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(cmd)}: {exc}"
    if done.returncode != 0:
        return f"{' '.join(cmd)} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-600:]}"
    return None


def build_library(compiler: str | None = None, directory: Path | None = None) -> tuple[Path, bool]:
    """The compiled library (built now, or found in the cache) and whether it was built with OpenMP.
    Raises KernelUnavailable naming the cause."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise KernelUnavailable("no C compiler found (cc, gcc or clang on PATH, or $CC)")
    directory = directory or cache_dir()
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"C compiler {compiler!r} does not run: {exc}") from exc
    attempts = [BASE_FLAGS + _arch_flags() + ("-fopenmp",), BASE_FLAGS + ("-fopenmp",),
                BASE_FLAGS + ("-fopenmp-simd",)]
    errors = []
    for flags in dict.fromkeys(attempts):
        key = hashlib.sha256(b"\0".join([source, compiler.encode(), version.encode(), " ".join(flags).encode(),
                                         platform.machine().encode(), _cpu_fingerprint().encode()])).hexdigest()[:24]
        path = directory / f"cpu_kernels-{key}.so"
        failed = path.with_suffix(".failed")
        if failed.exists():
            errors.append(failed.read_text(errors="replace"))
            continue
        if not path.exists():
            try:
                directory.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=directory)
                os.close(fd)
            except OSError as exc:
                raise KernelUnavailable(f"kernel cache {directory} is not writable: {exc} "
                                        f"(set HYBRIDRL_KERNEL_CACHE to a writable directory)") from exc
            error = _compile(compiler, flags, Path(tmp))
            if error is not None:
                Path(tmp).unlink(missing_ok=True)
                errors.append(error)
                failed.write_text(error)
                continue
            os.replace(tmp, path)
            log.info("built the native engine's CPU kernels: %s", path)
        return path, "-fopenmp" in flags
    raise KernelUnavailable("the C compiler could not build the kernels: " + " | ".join(errors))
