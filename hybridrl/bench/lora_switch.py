"""`hybridrl bench mode-switch --lora-rank R`: the mode switch of a LoRA run publishing the whole model
(merged, what an engine without adapters takes) against publishing the adapters only (what the native
engine, which applies them at run time, takes), side by side in one run.

Every rank holds the trainer (LoRA rank R on every projection) and two native engines of the same model:
one without adapters (full: each switch publishes every tensor, B A merged in) and one holding the frozen
base and the adapters (adapters: each switch publishes the A, B factors only). The cycles interleave the
two (full, adapters, then adapters, full, ...), each a whole TRAIN -> ROLLOUT -> TRAIN cycle of the
colocated mode switch with its parity probe, a new version each time, the adapters gathered anew each
time (as after an optimizer step). The cycle's time is its phases' (offload, publish, wake, sleep,
reload: what `hybridrl bench mode-switch` reports), the parity probe beside it. Reported per kind: the median and spread (min, max) of each phase
and of the whole cycle, bytes published, and the engine's decode rate (what applying the adapters at
run time costs while generating); and what merging the adapters into the engine's own weights at each
publication would cost instead (scale * B A added to every targeted weight, timed on the full engine).
"""

from __future__ import annotations

import statistics
import time

import torch

from hybridrl.bench.mode_switch import BenchProbe, _warm_up_step, _write
from hybridrl.controller.placements import build_colocated
from hybridrl.distributed.dispatch import ONE_TO_ALL
from hybridrl.jobs import Job
from hybridrl.workers.base import Part, register
from hybridrl.workers.config import SWITCH_PHASES
from hybridrl.workers.rank import RankWorker
from hybridrl.workers.rollout_side import RolloutSide
from hybridrl.workers.switch import ModeSwitch
from hybridrl.workers.train_side import TrainSide

KINDS = ("full", "adapters")
DECODE_PROMPTS, DECODE_TOKENS = 8, 32


class TwoEngines(Part):
    """The second engine of each rank and the switch between the two (`use`)."""

    def __init__(self, cfg, ctx, worker: RankWorker):
        from hybridrl.backends.native.engine import NativeEngine
        from hybridrl.publication.transport_inprocess import InProcessTransport

        self.cfg, self.ctx = cfg, ctx
        self.switch, self.rollout = worker.part(ModeSwitch), worker.part(RolloutSide)
        self.actor = worker.part(TrainSide).actor
        full = NativeEngine.from_pretrained(cfg.model.path, cfg.rollout.native, device=ctx.device)
        self.rollout.run(full.sleep(full.releasable_tags))          # in TRAIN: the engine holds no KV cache
        self.kinds = {"full": (full, InProcessTransport(full), self.actor),
                      "adapters": (self.switch.engine, self.switch.transport, self.switch.publisher.source)}

    @register(dispatch=ONE_TO_ALL)
    def use(self, *, kind: str) -> None:
        """The next switches publish into this kind's engine (in TRAIN mode); the adapters are gathered anew."""
        engine, transport, source = self.kinds[kind]
        self.switch.engine = self.rollout.engine = engine
        self.switch.transport, self.switch.publisher.source = transport, source
        self.actor._lora_full = None

    @register(dispatch=ONE_TO_ALL)
    def published_bytes(self) -> int:
        return self.switch.publisher.stats.bytes_copied

    @register(dispatch=ONE_TO_ALL)
    def decode_rate(self, *, vocab: int) -> float:
        """Generated tokens per second of the engine in use (greedy, DECODE_PROMPTS requests at once)."""
        from hybridrl.publication import parity
        from hybridrl.rollout.protocol import SamplingParams

        engine = self.rollout.engine
        prompts = parity.probe_prompts(vocab, DECODE_PROMPTS, length=16, seed=3)
        sampling = SamplingParams(max_new_tokens=DECODE_TOKENS, temperature=0.0, ignore_eos=True)

        async def go():
            import asyncio

            return await asyncio.gather(*[engine.generate(p, sampling, f"rate-{time.monotonic_ns()}-{i}")
                                          for i, p in enumerate(prompts)])

        started = time.perf_counter()
        outputs = self.rollout.run(go())
        return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started)

    @register(dispatch=ONE_TO_ALL)
    def merge_in_place_s(self, *, repeats: int = 3) -> float:
        """Seconds to merge the adapters into the full engine's own weights (per targeted weight W:
        W += scale * (B_new A_new - B_old A_old), one rank-2R product): the alternative to applying them at run
        time. Timed on copies of the weights, so the engine is left as it was."""
        engine = self.kinds["full"][0]
        factors, scale = self.actor.lora_factors(), self.cfg.train.lora.scale
        pairs = []
        for module, (a, b) in factors.items():
            w = engine.core.base_views[module + ".weight"]
            dev = dict(device=w.device, dtype=w.dtype)
            pairs.append((w.clone(), torch.cat([b, -b], 1).to(**dev), torch.cat([a, a], 0).to(**dev)))
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            for w, b2, a2 in pairs:
                w.addmm_(b2, a2, alpha=scale)
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)


def make_worker(cfg, ctx) -> RankWorker:
    worker = build_colocated(cfg, ctx)
    worker.extend(BenchProbe(cfg, ctx, worker.part(TrainSide)))
    return worker.extend(TwoEngines(cfg, ctx, worker))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_lora_bench(cfg, wg) -> dict:
    if cfg.train.lora.rank <= 0 or cfg.rollout.engine != "native":
        raise ValueError("the LoRA mode-switch benchmark needs train.lora.rank > 0 and rollout.engine=native")
    vocab = wg.call(BenchProbe.sizes)[0]["vocab_size"]
    _warm_up_step(wg, vocab)           # the optimizer's state exists, the adapters' B is no longer zero
    sizes = wg.call(BenchProbe.sizes)[0]
    cycles: dict[str, list[dict]] = {k: [] for k in KINDS}
    version = 0
    for cycle in range(cfg.trainer.total_steps):
        for kind in (KINDS if cycle % 2 == 0 else KINDS[::-1]):     # interleaved, the order alternating
            version += 1
            wg.call(TwoEngines.use, kind=kind)
            switch = wg.call(ModeSwitch.enter_rollout, version=version, step=version)
            rate = wg.call(TwoEngines.decode_rate, vocab=vocab)[0]
            switch.update(wg.call(ModeSwitch.enter_train))
            if not switch["published"]:
                raise RuntimeError(f"cycle {cycle} ({kind}): nothing was published")
            phases = {p: switch[f"switch/{p}_s"] for p in (*SWITCH_PHASES, "probe") if f"switch/{p}_s" in switch}
            cycles[kind].append({"phases": phases, "switch_s": sum(phases[p] for p in SWITCH_PHASES if p in phases),
                                 "with_probe_s": sum(phases.values()), "decode_tokens_per_s": rate,
                                 "bytes": wg.call(TwoEngines.published_bytes)[0],
                                 "parity_max_abs": switch.get("parity/max_abs", 0.0)})
    wg.call(TwoEngines.use, kind="full")
    merge_s = statistics.median(wg.call(TwoEngines.merge_in_place_s))
    kinds = {}
    for kind, runs in cycles.items():
        kinds[kind] = {"switch_s": _spread([r["switch_s"] for r in runs]),
                       "switch_with_probe_s": _spread([r["with_probe_s"] for r in runs]),
                       "phases": {p: _spread([r["phases"][p] for r in runs]) for p in runs[0]["phases"]},
                       "bytes_published": runs[0]["bytes"], "decode_tokens_per_s": _spread(
                           [r["decode_tokens_per_s"] for r in runs]),
                       "parity_max_abs": max(r["parity_max_abs"] for r in runs), "cycles": len(runs),
                       "switch_s_each": [r["switch_s"] for r in runs]}
    full, adapters = kinds["full"], kinds["adapters"]
    return _write(cfg, {
        "lora_rank": cfg.train.lora.rank, "lora_alpha": cfg.train.lora.alpha,
        "target_modules": list(cfg.train.lora.target_modules), "model_params": sizes["model_params"],
        "weight_bytes": sizes["weight_bytes"], "world_size": wg.world_size, "tp": cfg.train.tp,
        "device": str(wg.ctx.device), "verify": cfg.publish.verify, "kinds": kinds,
        "speedup_switch": full["switch_s"]["median"] / adapters["switch_s"]["median"],
        "speedup_switch_with_probe": full["switch_with_probe_s"]["median"] / adapters["switch_with_probe_s"]["median"],
        "speedup_publish": full["phases"]["publish"]["median"] / adapters["phases"]["publish"]["median"],
        "merge_in_engine_s": merge_s,
        "decode_slowdown": full["decode_tokens_per_s"]["median"] / adapters["decode_tokens_per_s"]["median"],
    })


def explain(result: dict) -> str:
    full, ad = result["kinds"]["full"], result["kinds"]["adapters"]

    def line(name, k):
        phases = ", ".join(f"{p} {v['median']:.3f}s" for p, v in k["phases"].items())
        return (f"  {name:<9} {k['switch_s']['median']:.3f}s per cycle (min {k['switch_s']['min']:.3f}, max "
                f"{k['switch_s']['max']:.3f}; {phases}); {k['bytes_published'] / 2**20:.2f} MiB published; decode "
                f"{k['decode_tokens_per_s']['median']:.0f} tokens/s")

    return "\n".join([
        f"LoRA rank {result['lora_rank']} on a {result['model_params'] / 1e6:.1f}M-parameter model, "
        f"{result['kinds']['full']['cycles']} interleaved cycles of each:",
        line("full", full), line("adapters", ad),
        f"adapter-only switch: {result['speedup_switch']:.1f}x faster per cycle ("
        f"{result['speedup_switch_with_probe']:.1f}x with the parity probe), its publish phase "
        f"{result['speedup_publish']:.1f}x; merging the adapters into the engine's weights instead would cost "
        f"{result['merge_in_engine_s']:.3f}s per publication; applying them at run time costs "
        f"{100 * (result['decode_slowdown'] - 1):.0f}% of decode speed"])


JOB = Job("bench_mode_switch_lora", make_worker, run_lora_bench)
