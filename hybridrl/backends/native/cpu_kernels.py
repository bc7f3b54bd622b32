"""The native engine's C kernels for the CPU (`cpu_kernels.c`): built on first use with the machine's C
compiler, cached, loaded with ctypes.

Why C: on a CPU, a decode step of a small model is a few hundred tiny problems, and torch's fixed
cost per operator (microseconds) is larger than their arithmetic. Attention was a third of the
demo model's decode step: `scaled_dot_product_attention` pays per (row, KV head) and needs each
row's blocks gathered into a padded copy first; the kernel reads the keys in place through the
block table. RMSNorm (a composite of six torch operators on the CPU), RoPE with the cache write,
and SiLU-and-multiply are one pass each. (An Inductor-compiled version of the attention loops,
`torch.compile`, was slower than SDPA on the machine this was written on, and took 21 s to compile.)

How the library is compiled and cached: `kernel_build.py`.

OpenMP (the attention kernel's threads): compiled with -fopenmp, the library needs libgomp.so.1,
which torch's CPU build has already loaded, so both share one thread pool. If loading it brings a
second OpenMP runtime into the process (a compiler linking another), the kernel runs on one thread
rather than fight torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridrl.backends.native.kernel_build import KernelUnavailable, build_library

log = logging.getLogger(__name__)

OPENMP_RUNTIMES = ("libgomp", "libomp", "libiomp")

# The most rows `linear` is used for: a decode step's (one per running sequence). Measured on a 2-core
# AMD EPYC with AVX-512 against torch's linear (MKL), the 12 layers of a ~100M-parameter model: 1.8x at 1
# row, 1.4x at 16, 1.3x at 32, 1.1-1.2x at 64; prefill chunks and training-sized products (hundreds of
# rows) stay with BLAS, which is faster there. Weights of fewer than LINEAR_MIN_WEIGHTS elements (1 MiB of
# float32; the demo model's, hidden 192, are all under it) stay with BLAS too: they sit in cache, and
# there the kernel was 0.84-1.08x of torch's (8-64 rows).
LINEAR_ROWS = 64
LINEAR_MIN_WEIGHTS = 1 << 18

__all__ = ["KernelUnavailable", "Kernels", "LINEAR_MIN_WEIGHTS", "LINEAR_ROWS", "build", "linear", "load",
           "paged_decode", "rms_norm", "rope_store", "silu_mul"]


@dataclass(frozen=True)
class Kernels:
    path: Path
    lib: ctypes.CDLL
    threaded: bool           # built with OpenMP and sharing torch's runtime


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
    path, openmp = build_library(compiler, directory)
    return _load(path, openmp)


def _load(path: Path, openmp: bool) -> Kernels:
    before = _openmp_mapped()
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "hybridrl_paged_decode_f32": ([ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, ctypes.c_int],
                                      ctypes.c_int),
        "hybridrl_rms_norm_f32": ([ptr, i64, ptr, ptr, i64, i64, f32], None),
        "hybridrl_silu_mul_f32": ([ptr, ptr, i64, i64], None),
        "hybridrl_rope_store_f32": ([ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64], None),
        "hybridrl_linear_f32": ([ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int], None),
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, kernels: Kernels | None = None) -> torch.Tensor:
    """x [N, K] (rows may be strided) @ weight [O, K].T (+ bias [O]) (+ residual [N, O]) -> [N, O]; meant for
    few rows (`LINEAR_ROWS`). A row's result depends on that row alone, not on the others in the call."""
    kernels = kernels or load()
    rows, k = x.shape
    out_features = weight.shape[0]
    _check("linear", x, weight, *(t for t in (bias, residual) if t is not None))
    if x.stride(1) != 1 or not weight.is_contiguous() or weight.shape[1] != k:
        raise ValueError(f"linear needs rows of x with contiguous elements and a contiguous [O, {k}] weight, got "
                         f"x {tuple(x.shape)} strides {x.stride()}, weight {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (out_features,) or not bias.is_contiguous()):
        raise ValueError(f"linear: bias {tuple(bias.shape)} is not a contiguous [{out_features}]")
    if residual is not None and (residual.shape != (rows, out_features) or not residual.is_contiguous()):
        raise ValueError(f"linear: residual {tuple(residual.shape)} is not a contiguous [{rows}, {out_features}]")
    out = torch.empty((rows, out_features), dtype=torch.float32)
    if rows == 0:
        return out
    kernels.lib.hybridrl_linear_f32(
        x.data_ptr(), x.stride(0), weight.data_ptr(), bias.data_ptr() if bias is not None else None,
        residual.data_ptr() if residual is not None else None, out.data_ptr(), rows, k, out_features,
        torch.get_num_threads() if kernels.threaded else 1)
    return out
