"""The process's C heap, shared by the engines that free large host tensors (the native engine's KV cache,
Megatron's spilled optimizer state)."""

from __future__ import annotations

import ctypes


def release_host_memory() -> None:
    """Return the pages freed tensors leave in glibc's heap to the OS (`malloc_trim(0)`); a no-op where the C
    library has none. Tensors below glibc's mmap threshold (which rises to the size of the largest block freed,
    up to 32 MiB) live in the heap, and freeing them lowers no resident size until the heap is trimmed. (No
    gc.collect: tensors are freed by reference count, and a full collection costs hundreds of milliseconds in
    a trainer process full of Python objects.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
