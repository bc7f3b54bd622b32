"""Digests of published tensors and the checkpoint hash built from them (import-light: torch, xxhash).

A tensor's digest is xxh3-128 over its name, dtype, shape and bytes (about as fast as a memory
copy, an order of magnitude faster than sha256, so hashing costs about one extra read of the
weights). A tensor off the CPU is first reduced on its own device to `device_checksum`, so hashing
never copies weights to host; the digest records which of the two it is. The sender hashes what it
sends, the receiver hashes its own storage after the copy: the two differ if the copy went wrong.
"""

from __future__ import annotations

import ctypes
from typing import Mapping, Sequence

import torch
import xxhash

HASH_ALGO = "xxh3_128"
_CHECKSUM_WORDS = 1 << 22          # words per chunk: bounds the index tensor at 32 MiB


def device_checksum(t: torch.Tensor) -> bytes:
    """Two position-weighted sums (mod 2**64) of the tensor's bytes read as 64-bit words, computed
    on the tensor's own device: no host copy of the weights. Odd weights make the first sum change
    with any single changed word; the second (sum of squared weighted words) catches compensating
    changes. A checksum against transport faults, not a cryptographic hash."""
    return _checksum(t).cpu().numpy().tobytes()


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """`device_checksum` as an int64 [2] tensor left on the tensor's device."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = b.numel() // 8 * 8
    words = b[:whole]
    if words.storage_offset() % 8:
        words = words.clone()
    words = words.view(torch.int64)
    tail = torch.zeros(8, dtype=torch.uint8, device=t.device)
    tail[: b.numel() - whole] = b[whole:]
    s1 = tail.view(torch.int64).sum() * (2 * words.numel() + 1)
    s2 = s1 * s1
    for start in range(0, words.numel(), _CHECKSUM_WORDS):
        chunk = words[start: start + _CHECKSUM_WORDS]
        weighted = chunk * torch.arange(2 * start + 1, 2 * (start + chunk.numel()), 2, dtype=torch.int64,
                                        device=t.device)
        s1 = s1 + weighted.sum()
        s2 = s2 + (weighted * weighted).sum()
    return torch.stack([s1, s2])


def tensor_digest(name: str, t: torch.Tensor, *, on_device: bool | None = None) -> str:
    """xxh3-128 over the tensor's name, dtype, shape and bytes; for a tensor off the CPU (or with
    `on_device=True`) over its `device_checksum` instead."""
    on_device = t.device.type != "cpu" if on_device is None else on_device
    return _digest(name, t, device_checksum(t) if on_device else None)


def tensor_digests(named: Sequence[tuple[str, torch.Tensor]], *, on_device: bool | None = None) -> dict[str, str]:
    """`tensor_digest` of every (name, tensor), with the device checksums of a device's tensors brought
    to the host together: one synchronisation per call, not one per tensor."""
    checked = [(n, t) for n, t in named if (t.device.type != "cpu" if on_device is None else on_device)]
    sums: dict[str, bytes] = {}
    for device in {t.device for _, t in checked}:
        here = [(n, t) for n, t in checked if t.device == device]
        host = torch.stack([_checksum(t) for _, t in here]).cpu().numpy()
        sums.update((n, host[i].tobytes()) for i, (n, _) in enumerate(here))
    return {n: _digest(n, t, sums.get(n)) for n, t in named}


def _digest(name: str, t: torch.Tensor, checksum: bytes | None) -> str:
    h = xxhash.xxh3_128()
    h.update(f"{name}|{str(t.dtype).replace('torch.', '')}|{tuple(t.shape)}|".encode())
    if checksum is not None:
        h.update(b"device_checksum|" + checksum)
    else:
        t = t.detach().contiguous()
        h.update(_host_bytes(t) if t.numel() else b"")
    return h.hexdigest()


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, read in place (valid while `t` lives). Not `t.numpy()`: exporting a
    tensor's buffer marks its storage as never resizable again, and the native engine resizes its weights'
    storage to release them (`rollout.native.release_weights`)."""
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr()))


def checkpoint_hash(digests: Mapping[str, str]) -> str:
    """The hash of a whole publication: xxh3-128 over the per-tensor digests in canonical (sorted
    name) order, so it does not depend on bucketing or on the order tensors were sent in."""
    h = xxhash.xxh3_128()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return f"{HASH_ALGO}:{h.hexdigest()}"
