"""megatron-core, imported with torch's compiler left unloaded until something compiled runs.

megatron-core decorates its fusion kernels with `torch.compile` at import time
(`megatron.core.jit.jit_fuser`, e.g. `fusions/fused_bias_geglu.py`), and calling `torch.compile`
imports TorchDynamo and Inductor, although nothing is compiled until a decorated function runs. On a
2-core machine that import is most of a rank's start-up (`import megatron.core` plus the GPT model:
5.7 s, of which ~4.2 s is the compiler stack), paid by every rank of every launch, for kernels the CPU
path never calls.

So megatron-core is imported here with `torch.compile` replaced, for the import only, by a decorator
that calls the real `torch.compile` the first time the decorated function runs: the same compilation,
with the same arguments, at the moment torch would have compiled it anyway (torch.compile is lazy
too); only the import of the compiler moves there. `torch.compile` itself is restored before this
module returns, so code that calls it later gets torch's own.

Every module of this package that imports megatron imports this one first.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_COMPILE = torch.compile


def _compile_on_first_call(model: Callable | None = None, **options: Any) -> Any:
    """`torch.compile(fn, **options)` / `@torch.compile(**options)`, compiled when `fn` first runs."""
    if model is None:
        return lambda fn: _compile_on_first_call(fn, **options)
    compiled: list[Callable] = []

    @functools.wraps(model)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            compiled.append(_COMPILE(model, **options))
        return compiled[0](*args, **kwargs)

    return run


def _import() -> None:
    torch.compile = _compile_on_first_call
    try:
        import megatron.core  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
    finally:
        torch.compile = _COMPILE


_import()
