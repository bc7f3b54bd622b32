"""The native engine's C kernels for the CPU (`cpu_kernels.c`): built on first use with the machine's C
compiler, cached, loaded with ctypes.

Why C: on a CPU, a decode step of a small model is a few hundred tiny problems, and torch's fixed
cost per operator (microseconds) is larger than their arithmetic. Attention was a third of the
demo model's decode step: `scaled_dot_product_attention` pays per (row, KV head) and needs each
row's blocks gathered into a padded copy first; the kernel reads the keys in place through the
block table. RMSNorm (a composite of six torch operators on the CPU), RoPE with the cache write,
and SiLU-and-multiply are one pass each. (An Inductor-compiled version of the attention loops,
`torch.compile`, was slower than SDPA on the machine this was written on, and took 21 s to compile.)

Build: `cc` (or `$CC`) with -O3, contraction into fused multiply-adds and the reassociation flags
that let reductions vectorise (not -ffast-math: its start-up code would make the whole process flush
denormals to zero), -march=native (-mcpu=native on Arm) where the compiler takes it, and OpenMP
where it is available. The library lands in `$HYBRIDRL_KERNEL_CACHE` (default
`$XDG_CACHE_HOME/hybridrl/kernels`, else `~/.cache/hybridrl/kernels`) under a name hashed from the
source, the compiler, the flags and the CPU's feature flags, so a cache shared between machines (a
home directory on a cluster) never hands one CPU's instructions to another. Concurrent builds
(several ranks) each write a file of their own and rename it into place. About 0.3 s with gcc.

OpenMP (the attention kernel's threads): compiled with -fopenmp, the library needs libgomp.so.1,
which torch's CPU build has already loaded, so both share one thread pool. If loading it brings a
second OpenMP runtime into the process (a compiler linking another), the kernel runs on one thread
rather than fight torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.c")
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math",
              "-fassociative-math", "-fno-signed-zeros")
OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp")


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded here; the message says why."""


@dataclass(frozen=True)
class Kernels:
    path: Path
    lib: ctypes.CDLL
    threaded: bool           # built with OpenMP and sharing torch's runtime


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


def _openmp_mapped() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in lines
            if line.count(" ") >= 5 and any(name in line.rsplit("/", 1)[-1] for name in OPENMP_RUNTIMES)}


def build(compiler: str | None = None, directory: Path | None = None) -> Kernels:
    """Compile (or find in the cache) and load the kernels. Raises KernelUnavailable naming the cause."""
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
                continue
            os.replace(tmp, path)
            log.info("built the native engine's CPU kernels: %s", path)
        return _load(path, openmp="-fopenmp" in flags)
    raise KernelUnavailable("the C compiler could not build the kernels: " + " | ".join(errors))


def _load(path: Path, openmp: bool) -> Kernels:
    before = _openmp_mapped()
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "hybridrl_paged_decode_f32": ([ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ctypes.c_int],
                                      ctypes.c_int),
        "hybridrl_rms_norm_f32": ([ptr, i64, ptr, ptr, i64, i64, f32], None),
        "hybridrl_silu_mul_f32": ([ptr, ptr, i64, i64], None),
        "hybridrl_rope_store_f32": ([ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64], None),
    }
    try:
        lib = ctypes.CDLL(str(path))
        for name, (args, result) in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = args, result
    except (OSError, AttributeError) as exc:
        raise KernelUnavailable(f"could not load {path}: {exc}") from exc
    added = _openmp_mapped() - before
    if added and before:
        log.warning("the native engine's CPU kernels brought a second OpenMP runtime (%s) beside torch's (%s): "
                    "their attention runs on one thread", sorted(added), sorted(before))
    return Kernels(path=path, lib=lib, threaded=openmp and not (added and before))


@functools.cache
def load() -> Kernels:
    """The kernels of this process (built once, then cached on disk and here)."""
    return build()


def _check(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"{name}: the CPU kernels take float32 CPU tensors, got {t.dtype} on {t.device}")


def paged_decode(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, kernels: Kernels | None = None) -> torch.Tensor:
    """Decode attention on one layer's paged cache: q [R, heads, head_dim] (rows may be strided: a view
    into the fused qkv projection), kv_layer [blocks, block_size, 2, kv_heads, head_dim], block_tables
    [R, W] int64, context_lens [R] int64 (>= 1) -> [R, heads * head_dim]."""
    kernels = kernels or load()
    rows, heads, head_dim = q.shape
    kv_heads = kv_layer.shape[3]
    _check("paged_decode", q, kv_layer)
    if q.stride(2) != 1 or q.stride(1) != head_dim or not kv_layer.is_contiguous():
        raise ValueError("paged_decode needs each row's heads contiguous and a contiguous cache layer")
    if heads % kv_heads:
        raise ValueError(f"paged_decode: {heads} query heads do not share {kv_heads} KV heads evenly")
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    out = torch.empty((rows, heads * head_dim), dtype=torch.float32)
    if rows == 0:
        return out
    status = kernels.lib.hybridrl_paged_decode_f32(
        q.data_ptr(), q.stride(0), kv_layer.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(), rows,
        heads, kv_heads, head_dim, kv_layer.shape[1], tables.shape[1], scale,
        torch.get_num_threads() if kernels.threaded else 1)
    if status != 0:
        raise MemoryError("paged_decode could not allocate its scratch memory")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: Kernels | None = None) -> torch.Tensor:
    """RMSNorm of x [N, dim] (rows may be strided) -> [N, dim]."""
    kernels = kernels or load()
    _check("rms_norm", x, weight)
    rows, dim = x.shape
    if x.stride(1) != 1 or not weight.is_contiguous() or weight.shape != (dim,):
        raise ValueError("rms_norm needs rows with contiguous elements and a contiguous [dim] weight")
    out = torch.empty((rows, dim), dtype=torch.float32)
    kernels.lib.hybridrl_rms_norm_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out


def silu_mul(gate_up: torch.Tensor, kernels: Kernels | None = None) -> torch.Tensor:
    """SiLU(gate) * up for gate_up [N, 2 * inter] (gate first), contiguous -> [N, inter]."""
    kernels = kernels or load()
    _check("silu_mul", gate_up)
    if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError("silu_mul needs a contiguous [N, 2 * inter] input")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=torch.float32)
    kernels.lib.hybridrl_silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, inter)
    return out


def rope_store(qkv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               kv_layer: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
               kernels: Kernels | None = None) -> None:
    """Rotate q and k of qkv [N, (heads + 2 kv_heads) * head_dim] in place (rows may be strided) with the
    rotary table [max_len, 2, head_dim / 2] at positions [N], then write each token's K and V into its
    cache slot (slots [N]) of kv_layer [blocks, block_size, 2, kv_heads, head_dim]."""
    kernels = kernels or load()
    _check("rope_store", qkv, table, kv_layer)
    if qkv.stride(1) != 1 or not table.is_contiguous() or not kv_layer.is_contiguous():
        raise ValueError("rope_store needs rows with contiguous elements, a contiguous table and cache layer")
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"rope_store: a row of {qkv.shape[1]} does not hold {heads} + 2 x {kv_heads} heads of "
                         f"{head_dim}")
    pos, slot = positions.contiguous(), slots.contiguous()
    kernels.lib.hybridrl_rope_store_f32(qkv.data_ptr(), qkv.stride(0), table.data_ptr(), pos.data_ptr(),
                                        slot.data_ptr(), kv_layer.data_ptr(), qkv.shape[0], heads, kv_heads, head_dim)
