"""Release device memory around the rollout phase, and bring it back.

- optimizer: Adam moments (and fp32 master copies that are not views of the model's parameter
  buffer) move to pinned host memory; reload moves them back.
- grads: the DDP gradient buffers are freed (they hold nothing between steps: every step zeroes
  them first) and reallocated, zeroed, on reload.
- params: the DDP parameter buffer (or, for a frozen model, each parameter) moves to pinned host
  memory. On a CPU device this is impossible by definition (the device *is* host memory) and
  reports 0 bytes; freeing the gradient buffers works on both.
- On a CPU device, optimizer state can instead be spilled to a file (`spill_dir`): written out
  and freed, so the rollout phase does not hold it in process memory; reload reads it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridrl.backends.heap import release_host_memory

if TYPE_CHECKING:
    from hybridrl.backends.megatron.engine import MegatronEngine


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())
    host.copy_(t, non_blocking=True)
    return host


def _buffers(engine: "MegatronEngine") -> list:
    return list(engine.ddp.buffers) + list(engine.ddp.expert_parallel_buffers) if engine.ddp else []


def _buffer_storages(engine: "MegatronEngine") -> set[int]:
    return {b.param_data.untyped_storage().data_ptr() for b in _buffers(engine) if b.param_data is not None}


def _optimizer_tensors(engine: "MegatronEngine"):
    """(holder, key, tensor) for every optimizer-owned tensor: Adam state and standalone master params."""
    if engine.optimizer is None:
        return
    model_storages = _buffer_storages(engine) | {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storages:
                    yield p, "data", p.data
                for key, value in inner.state[p].items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        yield inner.state[p], key, value


def offload(engine: "MegatronEngine", *, optimizer: bool, grads: bool, params: bool,
            spill_dir: Path | None = None) -> int:
    state = engine._offloaded
    on_device = engine.device.type != "cpu"
    moved = 0
    if optimizer and not on_device and spill_dir is not None and "spilled" not in state:
        records = list(_optimizer_tensors(engine))
        path = Path(spill_dir) / "optimizer_state.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save([t for _, _, t in records], path)
        for holder, key, tensor in records:
            moved += _nbytes(tensor)
            placeholder = torch.empty(0, dtype=tensor.dtype)
            if key == "data":
                holder.data = placeholder
            else:
                holder[key] = placeholder
        state["spilled"] = (path, [(holder, key) for holder, key, _ in records])
        records = tensor = None          # the last references to the spilled tensors
        release_host_memory()            # the freed state out of the process, not only back to its heap
    if optimizer and on_device and "optimizer" not in state:
        records = []
        for holder, key, tensor in list(_optimizer_tensors(engine)):
            host = _to_host(tensor)
            if key == "data":
                holder.data = host
            else:
                holder[key] = host
            records.append((holder, key))
            moved += _nbytes(tensor)
        state["optimizer"] = records
    if grads and engine.ddp is not None and "grads" not in state:
        moved += sum(_nbytes(b.grad_data) for b in _buffers(engine) if b.grad_data is not None)
        engine.ddp.offload_grad_buffers(synchronize=on_device, empty_cache=on_device)
        state["grads"] = True
    if params and on_device and "params" not in state:
        if engine.ddp is not None:
            for buffer in _buffers(engine):
                moved += _nbytes(buffer.param_data)
                buffer.offload_to_cpu(move_params=True, move_grads=False)
            state["params"] = "buffers"
        else:
            for p in engine.model.parameters():
                moved += _nbytes(p.data)
                p.data = _to_host(p.data)
            state["params"] = "tensors"
    if on_device:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved


def reload(engine: "MegatronEngine") -> int:
    state = engine._offloaded
    device = engine.device
    moved = 0
    kind = state.pop("params", None)
    if kind == "buffers":
        for buffer in _buffers(engine):
            buffer.reload_from_cpu(move_params=True, move_grads=False)
            moved += _nbytes(buffer.param_data)
    elif kind == "tensors":
        for p in engine.model.parameters():
            p.data = p.data.to(device, non_blocking=True)
            moved += _nbytes(p.data)
    if state.pop("grads", False):
        engine.ddp.restore_grad_buffers(synchronize=device.type != "cpu")
        moved += sum(_nbytes(b.grad_data) for b in _buffers(engine) if b.grad_data is not None)
    spilled = state.pop("spilled", None)
    if spilled is not None:
        path, records = spilled
        for (holder, key), tensor in zip(records, torch.load(path, weights_only=True)):
            if key == "data":
                holder.data = tensor
            else:
                holder[key] = tensor
            moved += _nbytes(tensor)
        path.unlink()
    for holder, key in state.pop("optimizer", []):
        if key == "data":
            holder.data = holder.data.to(device, non_blocking=True)
            moved += _nbytes(holder.data)
        else:
            holder[key] = holder[key].to(device, non_blocking=True)
            moved += _nbytes(holder[key])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return moved


def held_bytes(engine: "MegatronEngine") -> dict[str, int]:
    """Bytes the engine holds right now in optimizer state and gradient buffers (by accounting)."""
    optimizer = sum(_nbytes(t) for _, _, t in _optimizer_tensors(engine) if t.device == engine.device)
    grads = sum(_nbytes(b.grad_data) for b in _buffers(engine)
                if b.grad_data is not None and b.grad_data.untyped_storage().size() > 0)
    return {"optimizer_bytes_held": optimizer, "grad_bytes_held": grads}
