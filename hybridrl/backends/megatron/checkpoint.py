"""Distributed checkpoints (Megatron dist_checkpointing) and HF export.

A checkpoint directory holds the model and optimizer as sharded tensors (every rank writes its
shards in parallel), the LR schedule, step count and caller's `extra` state as common state
(rank 0), one RNG record per (pp, tp) position (CPU / device generators, Megatron's tracker), and
`rank_rng/rankNNNNN.json`: each rank's own Python, numpy and torch CPU generator states, restored
when the checkpoint loads at the same world size. The distributed optimizer is saved
`dp_reshardable` (megatron-core 0.16.1's `fully_reshardable` load fails with torch Adam:
KeyError 'step'): a checkpoint loads at another data-parallel size; tp and pp must match.

Launched scripts that save must guard their entry point with `if __name__ == "__main__":`
(dist_checkpointing's writer starts processes that import the main module).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from hybridrl.backends.megatron import upstream  # noqa: F401  (megatron-core imported first, there)
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel import get_cuda_rng_tracker

if TYPE_CHECKING:
    from hybridrl.backends.megatron.engine import MegatronEngine

FORMAT = "hybridrl-megatron/1"
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# Files copied next to the exported weights when the source directory has them.
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                 "tokenizer.model", "added_tokens.json")


def _sharded_state(engine: "MegatronEngine", *, is_loading: bool, extra: dict | None) -> dict:
    model_sd = engine.model.sharded_state_dict()
    state: dict[str, Any] = {
        "format": FORMAT,
        "model": model_sd,
        "rng": _rng_object(engine),
        "num_steps": engine.num_steps,
        "layout": {"tp": engine.cfg.tp, "pp": engine.cfg.pp, "family": engine.adapter.family},
        "extra": extra or {},
    }
    if engine.training:
        if is_loading:
            _init_adam_state(engine.optimizer)
        state["optimizer"] = engine.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                 metadata=_OPTIM_METADATA)
        state["scheduler"] = engine.scheduler.state_dict()
    return state


def save_checkpoint(engine: "MegatronEngine", path: Path, extra: dict) -> None:
    if dist.get_rank() == 0:
        if path.exists() and any(path.iterdir()):
            raise FileExistsError(f"checkpoint directory {path} exists and is not empty")
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if engine.training:
        # Before the first optimizer step torch Adam holds no state, and the distributed optimizer's
        # state_dict asserts on it (megatron-core 0.16 optimizer/distrib_optimizer.py: state_dict,
        # "assert len(steps) == 1"). Adam's own first step starts from exactly this state (zero
        # moments, step 0), so giving it now changes no number: a run that has not updated yet (no
        # trajectory admitted) checkpoints and resumes like any other.
        _init_adam_state(engine.optimizer)
    with _writer_results_queue():
        dist_checkpointing.save(_sharded_state(engine, is_loading=False, extra=extra), str(path),
                                content_metadata=_OPTIM_METADATA)
    _save_rank_rng(path)
    dist.barrier()


@contextlib.contextmanager
def _writer_results_queue():
    """An in-process results queue for megatron's checkpoint writer, for the duration of one save.

    megatron-core 0.16 (dist_checkpointing/strategies/filesystem_async.py:
    _get_write_results_queue) creates on first save a process-global `spawn` Manager queue: a
    server process of its own that lives until the trainer exits cleanly, and that nothing ends
    when the trainer is killed (it kept the run's files open, hundreds of MB resident). A
    synchronous save (what `save_checkpoint` does) calls the writer in this process
    (AsyncRequest.execute_sync): the queue is put to and read from here only, so a plain
    in-process queue serves, and no process is started for it. The writer's own per-bucket
    processes (forked, joined before the save returns) are set to die with this process
    (`_die_with_parent`), so a job killed mid-save leaves none of them behind either."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _saving
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.SimpleQueue()
    _saving = (os.getpid(), threading.get_ident())
    try:
        yield
    finally:
        _saving = None
        filesystem_async._results_queue = previous


_saving: tuple[int, int] | None = None   # (pid, thread) running a save: what it forks meanwhile are the writer's


def _die_with_parent() -> None:
    """In a process forked during a save: ask the kernel to SIGKILL it when its parent dies
    (Linux prctl PR_SET_PDEATHSIG); then, if the parent is already gone, exit at once."""
    if _saving is None or _saving[1] != threading.get_ident() or not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = _saving[0]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:        # the parent died between the fork and the prctl
        os._exit(1)


_PR_SET_PDEATHSIG = 1
os.register_at_fork(after_in_child=_die_with_parent)


def load_checkpoint(engine: "MegatronEngine", path: Path) -> dict:
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(f"{path}: not a distributed checkpoint (no metadata.json)")
    template = _sharded_state(engine, is_loading=True, extra=None)
    loaded = dist_checkpointing.load(template, str(path))
    if loaded.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {loaded.get('format')!r}")
    saved, want = loaded["layout"], {"tp": engine.cfg.tp, "pp": engine.cfg.pp, "family": engine.adapter.family}
    if saved != want:
        raise ValueError(f"{path}: saved with {saved}, this engine is {want}")
    missing, unexpected = engine.model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"{path}: model state mismatch: missing {missing[:3]}, unexpected {list(unexpected)[:3]}")
    if engine.training:
        if "optimizer" not in loaded:
            raise ValueError(f"{path}: holds no optimizer state (saved by a frozen engine)")
        engine.optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_step(engine.optimizer)
        engine.scheduler.load_state_dict(loaded["scheduler"])
    engine.num_steps = int(loaded["num_steps"])
    _restore_rng(loaded["rng"])
    _load_rank_rng(path)
    return loaded["extra"]


# ------------------------------------------------------------------------------------------------
# RNG: one record per rank (CPU generator, the device generator, Megatron's tracker states)


def _rng_object(engine: "MegatronEngine") -> ShardedObject:
    """One record per (pp, tp) position; data-parallel replicas share it (DP rank 0's is saved),
    so a checkpoint also loads at another DP size."""
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if engine.device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    pp, tp = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    return ShardedObject("rng_state", state, shape, (pp, tp), replica_id=ps.get_data_parallel_rank())


def _rank_rng_file(path: Path, rank: int) -> Path:
    return path / "rank_rng" / f"rank{rank:05d}.json"


def _save_rank_rng(path: Path) -> None:
    """This rank's own Python, numpy and torch CPU generators (the sharded record above holds one per
    (pp, tp) position, so it can load at another DP size): with them every rank of a run resumed at
    the same world size continues its exact random stream, whatever it draws between steps."""
    from hybridrl.store.checkpoints import capture_rng

    target = _rank_rng_file(path, dist.get_rank())
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"world_size": dist.get_world_size(), "rng": capture_rng()}))


def _load_rank_rng(path: Path) -> None:
    """Restore this rank's generators if the checkpoint was written at this world size."""
    from hybridrl.store.checkpoints import restore_rng

    source = _rank_rng_file(path, dist.get_rank())
    if source.exists():
        record = json.loads(source.read_text())
        if record["world_size"] == dist.get_world_size():
            restore_rng(record["rng"])


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _init_adam_state(optimizer) -> None:
    """Give every parameter of a fresh torch Adam its (zero) state, `step` included.

    megatron-core 0.16.1's sharded_state_dict for loading expects initialised state, and its own
    init (optimizer/__init__.py: init_state_fn) leaves out `step`, which torch's Adam then lacks."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state.setdefault("step", torch.zeros((), dtype=torch.float32))


def _restore_adam_step(optimizer) -> None:
    """Set torch Adam's per-parameter `step` from the loaded param groups.

    megatron-core 0.16.1 keeps `step` in param_groups; the distributed optimizer's dp_reshardable
    load then copies each parameter's *current* local `step` back over it (a non-persistent
    object in optimizer/distrib_optimizer.py: sharded_param_state_dp_reshardable), i.e. 0."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" in group:
                for p in group["params"]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


# ------------------------------------------------------------------------------------------------
# HF export


def export_hf(engine: "MegatronEngine", out_dir: Path) -> None:
    """Rank 0 writes model.safetensors (gathered through the adapter) and the source's side files."""
    from safetensors.torch import save_file

    is_writer = dist.get_rank() == 0
    tensors: dict[str, torch.Tensor] = {}
    # one model-parallel group gathers; with expert parallelism an expert comes from another
    # data-parallel rank, so every rank takes part (each expert-parallel group completes its own)
    if ps.get_data_parallel_rank() == 0 or engine.adapter.ep > 1:
        for name, tensor in engine.iter_hf_tensors():
            if is_writer:
                tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
    if is_writer:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        for name in HF_SIDE_FILES:
            src = engine.model_dir / name
            if src.exists() and src.resolve() != (out_dir / name).resolve():
                shutil.copyfile(src, out_dir / name)
        config = json.loads((engine.model_dir / "config.json").read_text())
        config["dtype"] = engine.cfg.dtype
        (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out_dir / "hybridrl_export.json").write_text(json.dumps(
            {"source": str(engine.model_dir), "num_steps": engine.num_steps, "family": engine.adapter.family},
            indent=2))
    dist.barrier()
