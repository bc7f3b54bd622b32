"""CUDA IPC handles between a rank and its vLLM worker, and the GPU that worker sees.

Import-light (torch only, no vllm): the engine, the worker and the CPU tests use it.

Devices. Every vLLM engine runs on its rank's GPU: its engine-core process (and the worker in it)
is started with CUDA_VISIBLE_DEVICES naming that GPU alone (`visible_device`), because vLLM takes
device 0 of whatever it sees (vllm 0.32 `engine/arg_utils.py:2219` builds DeviceConfig("cuda"),
`v1/executor/uniproc_executor.py:86-87` reads no index from it, so local rank 0). Inside the worker
that GPU is therefore `cuda:0`, while the rank knows it as `cuda:k`.

Handles. torch's `reduce_tensor` writes the sender's device index into the handle (argument 6 of
`rebuild_cuda_tensor`, torch/multiprocessing/reductions.py:153-169, 355-375); rebuilt as is in the
worker, `cuda:k` is a device it does not have ("invalid device ordinal"). So the sender writes the
GPU's UUID there instead and the worker maps it back to its own index by UUID, as SGLang does
(sglang 0.5.21 `srt/utils/patch_torch.py:72-99`), without patching torch's reductions globally.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Sequence

import torch

DEVICE_ARG = 6      # rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device, ...)

Handle = tuple[Callable[..., torch.Tensor], tuple]


def visible_device(index: int, environ: Mapping[str, str] | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES entry for this process's `cuda:index`: the index-th entry of this
    process's own CUDA_VISIBLE_DEVICES (an index, a GPU-/MIG- UUID, as given), or `index` itself when
    it is unset (every GPU visible)."""
    environ = os.environ if environ is None else environ
    if index < 0:
        raise ValueError(f"a CUDA device index is >= 0, got {index}")
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise ValueError(f"cuda:{index} is not among this process's CUDA_VISIBLE_DEVICES={visible!r} "
                         f"({len(entries)} device(s)): give the rank a device it can see")
    return entries[index]


def with_device(args: Sequence[Any], device: int | str) -> tuple:
    """`rebuild_cuda_tensor`'s arguments with the storage device replaced."""
    if len(args) <= DEVICE_ARG:
        raise ValueError(f"not a CUDA tensor handle: {len(args)} rebuild argument(s)")
    return (*args[:DEVICE_ARG], device, *args[DEVICE_ARG + 1:])


def local_device_index(device: int | str, local_uuids: Sequence[str]) -> int:
    """The index, in this process, of the GPU a handle names: by UUID (what `share` writes), or an
    index kept as is (a handle from a sender that wrote none)."""
    if isinstance(device, int):
        if not 0 <= device < len(local_uuids):
            raise ValueError(f"the handle names cuda:{device}; this process sees {len(local_uuids)} GPU(s)")
        return device
    for index, uuid in enumerate(local_uuids):
        if uuid == device:
            return index
    raise ValueError(f"the handle's GPU {device} is not visible to this process (it sees {list(local_uuids)}): "
                     "the engine's worker must run on the publishing rank's GPU")


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share(tensor: torch.Tensor) -> Handle:
    """A CUDA tensor's IPC handle naming its GPU by UUID (picklable: send it as bytes)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(f"a CUDA IPC handle needs a CUDA tensor, got one on {tensor.device}")
    rebuild, args = reduce_tensor(tensor)
    device = args[DEVICE_ARG]
    return rebuild, with_device(args, device if isinstance(device, str) else device_uuid(device))


def open_handle(handle: Handle, local_uuids: Sequence[str] | None = None) -> torch.Tensor:
    """The sender's tensor, opened on this process's index of its GPU."""
    rebuild, args = handle
    if local_uuids is None:
        local_uuids = [device_uuid(i) for i in range(torch.cuda.device_count())]
    return rebuild(*with_device(args, local_device_index(args[DEVICE_ARG], local_uuids)))
