"""`hybridrl plan --measure`: short calibrated benchmarks that replace the models fitted to a run.

    engine    the native engine on the model, in this process: batches of 1, 8, 32 and 64 sequences,
              at a short and a 4x longer prompt, each decoding a fixed number of tokens; every run
              gives (steps, decode tokens, prefill tokens, busy seconds), the rows `fit_engine`
              solves for base, per sequence and per prefill token (so batch and context both vary)
    trainer   Megatron's train step on the model (one rank, gloo), on batches shaped like the
              workload's episodes (prompt + response lengths), at the full batch and at half of it,
              for each micro-batch token budget in `budgets`; tokens/s by budget, and the run's
              budget's two sizes fix the fixed and the per-token cost apart
    tools     the task's in-process tools, called one after another (latency per call), and the
              python tool's sandbox start (one call through the pool), where this host can run it

Each figure is a median over repeats; the load average is recorded with them.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from hybridrl.cost.workload import EngineModel, TrainerModel, Workload, fit_engine, fit_trainer


def measure_engine(model_dir: str, *, batches=(1, 8, 32, 64), prompt_tokens=(32, 128), new_tokens: int = 24,
                   kv_cache_mb: int = 64, max_num_seqs: int = 64, repeats: int = 2) -> tuple[EngineModel, list[dict]]:
    import torch

    from hybridrl.backends.native.config import NativeEngineConfig
    from hybridrl.backends.native.core import EngineCore
    from hybridrl.rollout.protocol import SamplingParams

    cfg = NativeEngineConfig(kv_cache_mb=kv_cache_mb, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    core = EngineCore.from_pretrained(model_dir, cfg, device=torch.device("cpu"))
    vocab = core.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for rep in range(repeats):
        for length in prompt_tokens:
            for b in batches:
                before = dict(core.stats())
                for i in range(b):
                    prompt = torch.randint(10, vocab - 1, (length,), generator=gen).tolist()
                    core.add(core.make_sequence(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                                                       temperature=1.0, seed=i),
                                                f"m{rep}-{length}-{b}-{i}"))
                while core.has_work():
                    core.step()
                after = core.stats()
                rows.append({"engine/steps": after["steps"] - before["steps"],
                             "engine/step_time_s": after["step_time_s"] - before["step_time_s"],
                             "engine/decode_tokens": after["decode_tokens"] - before["decode_tokens"],
                             "engine/prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
                             "batch": b, "prompt_tokens": length})
    model = fit_engine(rows, ranks=1, max_batch=max_num_seqs)
    model.how = (f"--measure: the native engine on {model_dir}, batches {list(batches)} x prompts {list(prompt_tokens)} "
                 f"tokens, {new_tokens} new tokens each, {repeats} repeats; " + model.how)
    return model, rows


def _batch(lengths: list[tuple[int, int]], vocab: int):
    import torch

    from hybridrl.data.batch import Batch, pad_sequences

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (p + r,), generator=gen) for p, r in lengths]
    ids = pad_sequences(rows)
    mask = pad_sequences([[1] * (p + r) for p, r in lengths])
    loss_mask = mask.float()
    for i, (p, _) in enumerate(lengths):
        loss_mask[i, :p] = 0.0
    adv = torch.randn(len(lengths), 1, generator=gen).expand(-1, ids.shape[1]).contiguous()
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask, "advantages": adv})


def measure_trainer(model_dir: str, lengths: list[tuple[int, int]], *, budgets=(1024, 2048, 4096),
                    run_budget: int = 2048, micro_batch_size: int = 32, repeats: int = 3) -> tuple[TrainerModel, dict]:
    """Train steps on one rank; `lengths` are (prompt, response) tokens of the batch's episodes."""
    import torch.distributed as dist

    from hybridrl.backends.megatron import MegatronConfig, MegatronEngine

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo")

    def loss(logprobs, entropy, mb):
        return -mb["advantages"].to(logprobs.device) * logprobs, {}

    by_budget: dict[int, dict] = {}
    rows = []
    budgets = sorted(set(budgets) | {run_budget})
    for budget in budgets:
        engine = MegatronEngine.from_hf(model_dir, MegatronConfig(micro_batch_size=micro_batch_size,
                                                                  max_tokens_per_micro_batch=budget, lr=1e-6))
        vocab = engine.adapter.spec.vocab_size
        sizes = (lengths, lengths[: max(1, len(lengths) // 2)]) if budget == run_budget else (lengths,)
        for part in sizes:
            batch = _batch(part, vocab)
            engine.train_step(batch, loss)                       # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.train_step(batch, loss)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            policy = sum(r for _, r in part)
            if budget == run_budget:
                rows.append({"tokens/admitted": float(policy), "time/T_train": seconds})
            if part is lengths:
                by_budget[budget] = {"seconds": seconds, "tokens_per_s": sum(p + r for p, r in part) / seconds,
                                     "policy_tokens_per_s": policy / seconds}
        del engine
    model = fit_trainer(rows * 2, ranks=1)      # two sizes: base and per-token are fixed apart
    model.how = (f"--measure: Megatron train steps on one rank, {len(lengths)} and {len(lengths) // 2} episodes of the "
                 f"workload's lengths at max_tokens_per_micro_batch={run_budget} ({repeats} repeats, median); " + model.how)
    return model, by_budget


def measure_tools(calls: int = 20, sandbox_runs: int = 3) -> dict[str, Any]:
    """The calculator's latency per call, and the python tool's sandbox: the pool's start (probing the
    isolation) and a cold single-use sandbox per call (pool warm=0), where this host can run one."""
    import asyncio

    from hybridrl.agent.config import ToolsConfig
    from hybridrl.agent.tools.calculator import CalculatorTool

    async def calculator() -> list[float]:
        tool, times = CalculatorTool(), []
        for _ in range(calls):
            t0 = time.perf_counter()
            await tool({"expression": "4821 * 37"})
            times.append(time.perf_counter() - t0)
        return times

    out: dict[str, Any] = {"calculator_call_s": statistics.median(asyncio.run(calculator()))}

    async def sandbox() -> dict[str, Any]:
        from hybridrl.agent.sandbox.pool import SandboxPool

        pool = SandboxPool(ToolsConfig(pool_size=1, warm=0))
        t0 = time.perf_counter()
        await pool.start()
        started = time.perf_counter() - t0
        runs = []
        try:
            for _ in range(sandbox_runs):
                t0 = time.perf_counter()
                await pool.run("print(1)")
                runs.append(time.perf_counter() - t0)
        finally:
            await pool.close()
        return {"pool_start_s": started, "cold_call_s": statistics.median(runs), "isolation": pool.mode}

    try:
        out["sandbox"] = asyncio.run(sandbox())
    except Exception as err:            # no sandbox on this host: say why, measure the rest
        out["sandbox"] = f"unavailable: {type(err).__name__}: {err}"
    return out


def measure_into(w: Workload, rec: Any, *, model: str) -> dict[str, Any]:
    """Replace `w`'s engine and trainer models with measured ones (and calibrate the engine's factor
    again against the run's rollouts); returns what was measured."""
    from hybridrl.cost.fit import _mean_of, calibrate_rollout

    load = os.getloadavg()
    config = rec.config
    native = config.get("rollout", {}).get("native", {})
    eps = [e for g in w.groups for e in g]
    prompt = int(statistics.median(t.prompt_tokens for e in eps for t in e.turns[:1])) if eps else 32
    engine, engine_rows = measure_engine(model, prompt_tokens=(max(8, prompt), max(8, prompt) * 4),
                                         kv_cache_mb=int(native.get("kv_cache_mb", 64)),
                                         max_num_seqs=int(native.get("max_num_seqs", 64)))
    factor_before = w.rollout_factor
    w.engine = engine
    train = config.get("train", {})
    n = w.measured.prompts_per_step * w.measured.group_size
    lengths = [(sum(t.prompt_tokens for t in e.turns) or prompt, e.policy_tokens) for e in eps[:n]] or [(prompt, 32)] * 8
    budget = int(train.get("max_tokens_per_micro_batch", 0) or 2048)
    trainer, by_budget = measure_trainer(model, lengths, run_budget=budget,
                                         micro_batch_size=int(train.get("micro_batch_size", 32)))
    w.trainer = trainer            # one training rank measured; the run's ranks each take their share
    if w.measured.placement == "colocated":
        calibrate_rollout(w, steps=len(rec.step_rows()), target=_mean_of(rec.rows, "time/T_rollout"),
                          rows=rec.step_rows())
    w.notes.append(f"--measure replaced the fitted engine and trainer (load average {load[0]:.1f}); "
                   f"rollout_factor was {factor_before:.3f} with the fitted engine")
    return {"engine_rows": engine_rows, "trainer_by_budget": by_budget, "tools": measure_tools(), "load_average": load}
