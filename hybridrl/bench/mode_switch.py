"""`hybridrl bench mode-switch`: time full TRAIN -> ROLLOUT -> TRAIN cycles of the colocated
placement's mode switch against the machine's copy floor, measured in the same run.

Each cycle publishes a new version (so every cycle moves the weights), lets the engine serve one
short request, and returns to training. Reported per phase: median seconds, bytes moved, peak
memory (CUDA peak / process RSS). The floor is the bytes that must move in a full switch (the
weights into each rank's engine; optimizer state out and back when it is offloaded or spilled)
over the memcpy bandwidth of a same-sized buffer copy on every rank at once (and the gradient
buffers, released for the rollout phase, written once more when they come back).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from hybridrl.controller.placements import build_colocated
from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.data.batch import Batch, pad_sequences
from hybridrl.jobs import Job
from hybridrl.workers.base import Part, register
from hybridrl.workers.config import SWITCH_PHASES
from hybridrl.workers.rank import RankWorker
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.switch import ModeSwitch
from hybridrl.workers.train_side import TrainSide


def _bytes_per_s(fn, nbytes: int, device: torch.device, repeats: int) -> float:
    """Median bytes/s of `repeats` calls of fn handling `nbytes` (device-synchronised on CUDA)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def copy_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median bytes/s on `device` of `nbytes` copied between two preallocated buffers (the floor's
    bandwidth)."""
    n = max(1, nbytes // 4)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)                      # first touch: page faults are not bandwidth
    return _bytes_per_s(lambda: dst.copy_(src), n * 4, device, repeats)


def first_touch_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median bytes/s on `device` of `nbytes` zero-filled into a buffer allocated just before: what
    re-creating a released buffer costs, page faults included (reported, not in the floor)."""
    n = max(1, nbytes // 4)
    return _bytes_per_s(lambda: torch.empty(n, device=device).zero_(), n * 4, device, repeats)


class BenchProbe(Part):
    """What the benchmark measures on each rank beside the colocated sides."""

    def __init__(self, cfg, ctx, train: TrainSide):
        self.cfg, self.ctx, self.train = cfg, ctx, train

    @register(dispatch=ONE_TO_ALL)
    def copy_bandwidth(self, nbytes: int, repeats: int = 5) -> dict[str, float]:
        """`copy_bandwidth` and `first_touch_bandwidth` of `nbytes` on this rank's device."""
        return {"copy": copy_bandwidth(nbytes, self.ctx.device, repeats),
                "first_touch": first_touch_bandwidth(nbytes, self.ctx.device, repeats)}

    @register(dispatch=ONE_TO_ALL)
    def sizes(self) -> dict:
        actor = self.train.actor
        spec = actor.hf_spec()
        weights = sum(int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
                      for shape, dtype in spec.values())
        from hybridrl.backends.model_spec import ModelSpec

        vocab = ModelSpec.from_dir(self.cfg.model.path).vocab_size
        return {"model_params": actor.num_parameters(), "weight_bytes": weights, "vocab_size": int(vocab),
                **actor.held_bytes()}


def make_bench_worker(cfg, ctx) -> RankWorker:
    worker = build_colocated(cfg, ctx)
    return worker.extend(BenchProbe(cfg, ctx, worker.part(TrainSide)))


def _warm_up_step(wg, vocab: int) -> None:
    """One update on a synthetic batch, so the optimizer state exists (torch Adam creates it lazily)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 32), generator=g)
    mask = torch.ones(4, 32)
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones(4, 32, dtype=torch.long), "loss_mask": mask})
    old = wg.call(TrainSide.compute_logprobs, batch)["old_logprobs"]
    batch.set("old_logprobs", old)
    batch.set("behavior_logprobs", old.clone())
    batch.set("advantages", torch.randn(4, 1, generator=g).expand(4, 32).contiguous())
    wg.call(TrainSide.train_step, batch)


def run_bench(cfg, wg) -> dict:
    cycles = cfg.trainer.total_steps
    _warm_up_step(wg, wg.call(BenchProbe.sizes)[0]["vocab_size"])
    sizes = wg.call(BenchProbe.sizes)[0]
    switches = []
    for version in range(1, cycles + 1):
        switch = wg.call(ModeSwitch.enter_rollout, version=version, step=version)
        wg.call(RolloutSide.sample, prompts=[[1, 2, 3, 4]], max_new_tokens=4)
        switch.update(wg.call(ModeSwitch.enter_train))
        switches.append(switch)
    phases = wg.call(ModeSwitch.phase_summary)
    measured = wg.call(BenchProbe.copy_bandwidth, nbytes=sizes["weight_bytes"])
    bandwidth = statistics.median(m["copy"] for m in measured)
    first_touch = statistics.median(m["first_touch"] for m in measured)
    spill = cfg.hybrid.spill_optimizer or wg.ctx.device.type == "cuda"
    # what a full switch cannot avoid: the weights into each engine; optimizer state out and back
    # when it leaves the device (GPU: to pinned host memory; CPU: spilled to a file); the gradient
    # buffers re-created (written once, zeroed) after being released for the rollout phase, which
    # happens only where they leave (a CPU device keeps them unless the optimizer spills)
    must_move = {"weights_into_engine": sizes["weight_bytes"],
                 "optimizer_out_and_back": 2 * sizes["optimizer_bytes_held"] if spill else 0,
                 "gradient_buffers_restored": sizes["grad_bytes_held"] if spill else 0}
    floor = sum(must_move.values()) / bandwidth
    switch_s = sum(phases[p]["median_s"] for p in SWITCH_PHASES if p in phases)
    return {
        "model_params": sizes["model_params"], "vocab_size": sizes["vocab_size"], "world_size": wg.world_size,
        "tp": cfg.train.tp, "rollout_tp": cfg.rollout.tp, "engine": cfg.rollout.engine, "verify": cfg.publish.verify,
        "spill_optimizer": cfg.hybrid.spill_optimizer, "cycles": cycles, "device": str(wg.ctx.device),
        "phases": {name: {"median_s": p["median_s"], "bytes": p["bytes"], "peak_mem_bytes": p["peak_mem_bytes"]}
                   for name, p in phases.items() if name in SWITCH_PHASES},
        "publish_prepare_median_s": statistics.median(s.get("switch/publish_prepare_s", 0.0) for s in switches),
        "publish_deliver_median_s": statistics.median(s.get("switch/publish_deliver_s", 0.0) for s in switches),
        "switch_s": switch_s, "bytes_must_move": must_move, "copy_bandwidth_bytes_per_s": bandwidth,
        "first_touch_write_bytes_per_s": first_touch,
        "load_average_1m": os.getloadavg()[0],
        "host_huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1",          # other work on the machine during the run
        "copy_floor_s": floor, "ratio_to_floor": switch_s / floor if floor else None,
        "parity_max_abs": max(s.get("parity/max_abs", 0.0) for s in switches),
        "published_cycles": sum(bool(s["published"]) for s in switches),
        "in_place_cycles": int(sum(s.get("publish/in_place", 0.0) for s in switches)),   # written into the engine
        "retried_tensors": sum(s.get("publish/retried_tensors", 0.0) for s in switches),
    }


def bench(cfg, wg) -> dict:
    return _write(cfg, run_bench(cfg, wg))


def bench_and_serve(cfg, wg) -> dict:
    """The GPU check kit's run (benchmarks/gpu_check.py): the benchmark's cycles, then on the last
    published version the engine's greedy continuations of fixed prompts (ids, logprobs) and the
    trainer's logprobs of the same sequences, with the weights exported to <run.dir>/hf, so that
    transformers can score both against the weights that were served."""
    from hybridrl.publication import parity

    result = run_bench(cfg, wg)
    cycles = cfg.trainer.total_steps
    prompts = parity.probe_prompts(result["vocab_size"], 4, length=6, seed=0)
    wg.call(ModeSwitch.enter_rollout, version=cycles, step=cycles)      # serving it already: no publication
    served = wg.call(RolloutSide.sample, prompts=prompts, max_new_tokens=16)[0]
    wg.call(ModeSwitch.enter_train)
    rows = [p + o["token_ids"] for p, o in zip(prompts, served)]
    batch = Batch({"input_ids": pad_sequences(rows), "attention_mask": pad_sequences([[1] * len(r) for r in rows])})
    trainer = wg.call(TrainSide.compute_logprobs, batch)["old_logprobs"]        # [B, T] token-aligned
    wg.call(TrainSide.export_hf, out_dir=str(Path(cfg.run.dir) / "hf"))
    result["served"] = [{"prompt": p, "token_ids": o["token_ids"], "engine_logprobs": o["logprobs"],
                         "trainer_logprobs": trainer[b, len(p): len(r)].tolist(), "policy_version": o["policy_version"]}
                        for b, (p, o, r) in enumerate(zip(prompts, served, rows))]
    result["trainer_dtype"] = cfg.train.dtype
    return _write(cfg, result)


def _write(cfg, result: dict) -> dict:
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run.dir) / "mode_switch.json").write_text(json.dumps(result, indent=1))
    return result


JOB = Job("bench_mode_switch", make_bench_worker, bench)
SERVE_JOB = Job("bench_mode_switch_and_serve", make_bench_worker, bench_and_serve)
