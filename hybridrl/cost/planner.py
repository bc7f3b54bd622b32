"""`hybridrl plan`: stage capacities, the bottleneck, and the configuration to run.

    hybridrl plan RUN_DIR                          fit the workload of a run (its ledger and metrics)
    hybridrl plan RUN_DIR --measure                ... with the engine (by batch and context), the
                                                   trainer (by micro-batch token budget) and the
                                                   tools measured by short benchmarks instead
    ... --ranks N | --nodes K | --target-tokens-per-s X   for N ranks, K nodes, or what reaches X
    ... --what-if model_scale=4 context_scale=2 tool_latency_s=0.5 tool_scale=3
    ... --json

The procedure: measure one episode distribution (the run's ledger: per turn the prompt tokens
computed, the tokens generated, the tool / environment seconds; the verifier's seconds; rewards
and statuses), fit the stage models (`workload.py`), solve the stage capacities of the throughput
model

    T_update = T_rollout + T_reward + T_prep + T_train + T_sync (+ T_eval amortised)
    throughput <~ min(C_rollout, C_env, C_reward, C_train)       (pipelined; colocated stages share
                                                                   the devices, so their times add)

name the bottleneck, then simulate each candidate configuration (`simulate.py`: batching, stragglers,
partial rollouts, lag and its filter) and recommend the fastest in admitted tokens/s. Every figure
says how it was derived. What the planner cannot know is listed with the answer.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
from typing import Any

from hybridrl.cost.simulate import Config, SimResult, simulate
from hybridrl.cost.workload import Workload

CANNOT_KNOW = [
    "contention between processes sharing a host (memory bandwidth, page faults, other jobs): the per-rank "
    "rates are the measured ones, so a placement that runs stages side by side on one host may measure slower",
    "a disaggregated publication's cost when none was measured: taken equal to the colocated switch, which moves "
    "the same weights",
    "how the policy changes the episodes as it learns (lengths, tool calls, rewards drift): the distribution is "
    "the measured one",
    "data-parallel scaling past the measured rank count (all-reduce, the controller's own work grow with it): "
    "training time per token is assumed to fall as 1/ranks",
    "tail events the measurement did not see (tool outages, preemptions, a slow node), and failures: provision "
    "the headroom",
    "for --what-if model_scale: the per-step overhead (kernel launches, Python) is kept, the per-token work scales "
    "with the parameter count; context_scale keeps the per-token cost (attention's growth with context is not "
    "modelled)",
]


# ---------------------------------------------------------------------------- what-if


def what_if(w: Workload, changes: dict[str, float]) -> Workload:
    """The workload under another model size, context length or tool latency (see --help)."""
    out = copy.deepcopy(w)
    k = float(changes.get("model_scale", 1.0))
    if k != 1.0:
        out.engine.per_seq_s *= k
        out.engine.per_prefill_token_s *= k
        out.trainer.per_token_s *= k
        out.overheads.publish_s *= k
        out.overheads.sync_s *= k
        out.notes.append(f"what-if model_scale={k:g}: per-token engine and trainer costs and the weight moves x{k:g}")
    c = float(changes.get("context_scale", 1.0))
    if c != 1.0:
        for t in _turns(out):
            t.generated = max(1, round(t.generated * c))
            t.prompt_tokens = round(t.prompt_tokens * c)
        out.notes.append(f"what-if context_scale={c:g}: every turn's prompt and generated tokens x{c:g}")
    f = float(changes.get("tool_scale", 1.0))
    if "tool_latency_s" in changes:
        waits = [t.wait_s for g in out.groups for e in g for t in e.turns[:-1]]
        mean = sum(waits) / len(waits) if waits else 0.0
        target = float(changes["tool_latency_s"])
        if mean > 0:
            f *= target / mean
        else:
            for t in _turns(out, last=False):
                t.wait_s = target
        out.notes.append(f"what-if tool_latency_s={target:g}: tool / environment waits scaled to that mean")
    if f != 1.0:
        for t in _turns(out):
            t.wait_s *= f
        out.notes.append(f"what-if: tool / environment waits x{f:.3g}")
    unknown = set(changes) - {"model_scale", "context_scale", "tool_latency_s", "tool_scale"}
    if unknown:
        raise ValueError(f"--what-if {sorted(unknown)[0]}: unknown (use model_scale, context_scale, tool_latency_s, "
                         "tool_scale)")
    return out


def _turns(w: Workload, *, last: bool = True) -> list:
    """Every turn of the workload once (shapes may share objects: a resampled or repeated episode)."""
    seen: dict[int, Any] = {}
    for g in w.groups:
        for e in g:
            for t in (e.turns if last else e.turns[:-1]):
                seen.setdefault(id(t), t)
    return list(seen.values())


# ---------------------------------------------------------------------------- capacities


def capacities(w: Workload, cfg: Config) -> dict[str, dict]:
    """Per-stage capacity in admitted tokens/s for `cfg`'s ranks, each with how it is derived."""
    eps = [e for g in w.groups for e in g]
    n_eps = max(len(eps), 1)
    tokens_per_ep = sum(e.policy_tokens for e in eps) / n_eps
    turns_per_ep = sum(len(e.turns) for e in eps) / n_eps
    per_rank = cfg.prompts_per_step * cfg.group_size / max(cfg.rollout_ranks, 1)
    batch = min(per_rank, cfg.max_concurrent, w.engine.max_batch)
    prefill_per_ep = sum(t.prompt_tokens for e in eps for t in e.turns) / n_eps
    # one engine at the workload's batch: a step serves `batch` sequences one token each
    step = w.engine.step_s(batch) * w.rollout_factor
    prefill_s_per_token = w.engine.per_prefill_token_s * w.rollout_factor * prefill_per_ep / max(tokens_per_ep, 1e-9)
    rate = cfg.rollout_ranks / (step / batch + prefill_s_per_token) if batch else 0.0
    admitted = _admitted_share(w, cfg)
    out = {"rollout": {"tokens_per_s": rate * admitted, "how": (
        f"{cfg.rollout_ranks} engine(s) x {batch:.0f} sequences per step / ({step * 1e3:.2f} ms per step = "
        f"(base {w.engine.base_s * 1e3:.2f} + {batch:.0f} x {w.engine.per_seq_s * 1e3:.3f} ms) x rollout_factor "
        f"{w.rollout_factor:.2f}, + prefill {w.engine.per_prefill_token_s * 1e6:.1f} us x {prefill_per_ep:.0f} prompt "
        f"tokens per episode) x admitted share {admitted:.2f}; never starved: waits and stragglers not counted")}}
    train_ranks = cfg.train_ranks
    batch_tokens = cfg.prompts_per_step * cfg.group_size * tokens_per_ep * admitted
    t_train = w.trainer.seconds(batch_tokens, train_ranks)
    out["train"] = {"tokens_per_s": batch_tokens / t_train if t_train > 0 else math.inf, "how": (
        f"{batch_tokens:.0f} admitted tokens per step / (base {w.trainer.base_s:.3f}s + "
        f"{w.trainer.per_token_s * 1e3:.4f} ms x tokens / {train_ranks} rank(s) = {t_train:.3f}s)")}
    waits = sum(t.wait_s for e in eps for t in e.turns) / n_eps
    out["env"] = {"tokens_per_s": math.inf, "how": (
        f"{waits:.3f}s of tool / environment waits per episode over {turns_per_ep:.2f} turns; the tools run "
        "concurrently without a pool limit (agent.max_concurrent_episodes bounds them), so they add latency, not a "
        "capacity bound")}
    reward_s = sum(e.reward_s for e in eps) / n_eps
    out["reward"] = {"tokens_per_s": (cfg.rollout_ranks * tokens_per_ep * admitted / reward_s if reward_s > 0
                                      else math.inf), "how": (
        f"{cfg.rollout_ranks} rank(s) each verifying one episode at a time, {reward_s * 1e3:.2f} ms per episode, "
        f"{tokens_per_ep:.1f} policy tokens per episode x admitted share {admitted:.2f}" if reward_s > 0 else
        "the verifier's seconds are 0 in the ledger (not timed, or too short to count): no bound")}
    return out


def _inverse(rate: float) -> float:
    """Seconds per token of a stage capacity: 0 for an unbounded stage, inf for one that admits nothing."""
    if not math.isfinite(rate):
        return 0.0
    return 1 / rate if rate > 0 else math.inf


def _admitted_share(w: Workload, cfg: Config) -> float:
    eps = [(e, g) for g in w.groups for e in g]
    if not eps:
        return 0.0
    kept = 0
    for e, g in eps:
        rewards = [m.reward for m in g]
        if e.status in ("infra_invalid", "aborted") or (cfg.drop_truncated and e.truncated):
            continue
        if cfg.drop_all_equal_groups and max(rewards) - min(rewards) <= 1e-9:
            continue
        kept += e.policy_tokens
    return kept / max(sum(e.policy_tokens for e, _ in eps), 1)


def bound(w: Workload, cfg: Config, caps: dict[str, dict]) -> dict[str, Any]:
    """The throughput model's bound for `cfg`: pipelined (disaggregated) min of the stages; colocated
    the stages take turns on the same devices, so their times per token add."""
    overhead = w.overheads.per_step(cfg.placement)
    eps = [e for g in w.groups for e in g]
    tokens_step = cfg.prompts_per_step * cfg.group_size * (sum(e.policy_tokens for e in eps) / max(len(eps), 1)) \
        * _admitted_share(w, cfg)
    c = {k: v["tokens_per_s"] for k, v in caps.items()}
    per_step = overhead / max(tokens_step, 1e-9)
    if cfg.placement == "colocated":     # a stage that admits nothing (C = 0) makes the bound 0
        per_token = _inverse(c["rollout"]) + _inverse(c["train"]) + _inverse(c["reward"])
        value = 1 / (per_token + per_step) if per_token + per_step > 0 else math.inf
        how = ("colocated: 1 / (1/C_rollout + 1/C_train + 1/C_reward + per-step overhead "
               f"{overhead:.3f}s / {tokens_step:.0f} tokens)")
    else:
        trainer = _inverse(c["train"]) + per_step
        value = min(c["rollout"], c["reward"], 1 / trainer if trainer > 0 else math.inf)
        how = f"disaggregated: min(C_rollout, C_reward, the trainer with {overhead:.3f}s of per-step overhead)"
    finite = {k: v for k, v in c.items() if math.isfinite(v)}
    neck = min(finite, key=finite.get) if finite else "none"
    return {"tokens_per_s": value, "bottleneck": neck, "how": how}


# ---------------------------------------------------------------------------- how far to trust it

MIN_R2 = 0.5              # an engine fit below this explains too little of the rows' busy time to predict others
MAX_TRAIN_ERROR = 0.25    # a trainer fit whose residual exceeds this share of the mean T_train
FIRM_UP = ("run more steps (trainer.total_steps=10 or more, at several batch sizes), or measure the stages with "
           "`hybridrl plan RUN_DIR --measure`")


def reliability(w: Workload) -> list[dict[str, Any]]:
    """The fitted stage models too poor to predict from, each with why: every throughput the plan
    gives rests on them, so a poor fit makes the recommendation a guess, said as such."""
    out = []
    e, t = w.engine, w.trainer
    if e.r2 is not None and e.r2 < MIN_R2:
        out.append({"model": "engine", "r2": e.r2, "rows": e.rows, "why": (
            f"the engine fit explains {100 * max(e.r2, 0.0):.0f}% of the variation of the engine's busy time over "
            f"{e.rows} step rows (R^2 {e.r2:.2f} < {MIN_R2}): those seconds do not follow the batch and token counts "
            "(too few rows, batches too alike, or a shared host's noise), so C_rollout and every candidate's rollout "
            "time are rough")})
    if t.rel_error is not None and t.rel_error > MAX_TRAIN_ERROR:
        out.append({"model": "trainer", "rel_error": t.rel_error, "rows": t.rows, "why": (
            f"the trainer fit misses the measured T_train by {100 * t.rel_error:.0f}% (RMS, over {t.rows} step rows; "
            f"> {100 * MAX_TRAIN_ERROR:.0f}%): C_train and every candidate's update time are rough")})
    return out


# ---------------------------------------------------------------------------- candidates


def candidates(w: Workload, ranks: int, *, placements=("colocated", "disaggregated"), prompts: int | None = None,
               lags=(1, 2, 4, 8), disaggregated_lags=(0, 1, 2), oversamples=(1.25, 1.5, 2.0)) -> list[Config]:
    m = w.measured
    base = dict(prompts_per_step=prompts or m.prompts_per_step, group_size=m.group_size,
                max_concurrent=m.max_concurrent, drop_truncated=m.drop_truncated,
                drop_all_equal_groups=m.drop_all_equal_groups)
    out = []
    if "colocated" in placements:
        out.append(Config(placement="colocated", train_ranks=ranks, rollout_ranks=ranks, rollout_mode="sync",
                          max_policy_lag=-1, **base))
        for o in oversamples:
            for lag in lags:
                if lag >= 1:        # a continued episode is a version behind: lag 0 would drop every one
                    out.append(Config(placement="colocated", train_ranks=ranks, rollout_ranks=ranks,
                                      rollout_mode="partial", oversample=o, max_policy_lag=lag, **base))
    if "disaggregated" in placements and ranks >= 2:
        for r in range(1, ranks):
            if base["prompts_per_step"] % r:
                continue
            for lag in disaggregated_lags:
                out.append(Config(placement="disaggregated", train_ranks=ranks - r, rollout_ranks=r,
                                  max_policy_lag=lag, **base))
    return out


def default_config(w: Workload, ranks: int) -> Config:
    """What a recipe that sets none of these keys runs: colocated, synchronous, no lag filter."""
    m = w.measured
    return Config(placement="colocated", train_ranks=ranks, rollout_ranks=ranks, rollout_mode="sync",
                  max_policy_lag=-1, prompts_per_step=m.prompts_per_step, group_size=m.group_size,
                  max_concurrent=m.max_concurrent, drop_truncated=m.drop_truncated,
                  drop_all_equal_groups=m.drop_all_equal_groups)


def queue_bounds(cfg: Config, result: SimResult) -> dict[str, Any]:
    if cfg.placement == "disaggregated":
        ahead = max(1, cfg.max_policy_lag)
        return {"groups_granted_ahead": ahead * cfg.prompts_per_step, "expected_queue_depth": result.queue_depth,
                "how": f"ahead = max(1, max_policy_lag) = {ahead} steps of {cfg.prompts_per_step} groups are granted "
                       "beyond the step being trained (the StreamCollection bound); the expected depth is the "
                       "simulated mean of episodes running or waiting at a step's end"}
    if cfg.rollout_mode == "partial":
        return {"trainer.oversample": cfg.oversample, "groups_in_flight": cfg.groups_in_flight,
                "trainer.queue_max_groups": cfg.groups_in_flight, "expected_queue_depth": result.queue_depth,
                "how": "groups in flight = ceil(prompts_per_step x oversample); a queue (max_groups_per_step) of "
                       "that many groups never blocks a launch; the expected depth is the simulated mean of episodes "
                       "carried across a step"}
    return {"expected_queue_depth": 0.0, "how": "synchronous: nothing is carried across a step"}


def length_shift(r: SimResult) -> float:
    """Selection bias: of the episodes launched early in the simulated window, how far the admitted ones'
    mean length (their full, measured length) is from all of theirs (relative). Completion-time
    filtering and a tight lag bound drop the long ones; the group filter drops by reward, not length."""
    sel = r.launched.get("selection") or {}
    a, lo = sel.get("admitted_length_mean"), sel.get("launched_length_mean")
    return abs(a - lo) / lo if a is not None and lo else 0.0


def plan(w: Workload, *, ranks: int | None = None, target: float | None = None, headroom: float = 0.8,
         placements=("colocated", "disaggregated"), steps: int = 30, warmup: int = 2,
         max_shift: float = 0.1) -> dict[str, Any]:
    """The answer: capacities and bottleneck at the measured configuration, every candidate simulated,
    the recommendation (and, for a target, the ranks it needs)."""
    from hybridrl.cost.fit import measured_as_config

    measured_cfg = measured_as_config(w)
    out: dict[str, Any] = {"workload": w.describe(), "cannot_know": CANNOT_KNOW, "unreliable": reliability(w)}
    caps = capacities(w, measured_cfg)
    out["measured"] = {"config": dataclasses.asdict(measured_cfg), "label": measured_cfg.label(),
                       "capacities": caps, "bound": bound(w, measured_cfg, caps),
                       "admitted_tokens_per_s": w.measured_admitted_tokens_per_s, "step_s": w.measured_step_s}
    n = ranks or measured_cfg.world_size
    prompts = None
    if target:
        n, prompts, sizing = _size_for_target(w, measured_cfg, target, headroom, placements)
        out["target"] = sizing
    table = []
    for cfg in candidates(w, n, placements=placements, prompts=prompts):
        r = simulate(w, cfg, steps=steps, warmup=warmup)
        table.append((cfg, r))
    table.sort(key=lambda cr: -cr[1].admitted_tokens_per_s)
    # a configuration whose admitted episodes are not the launched ones (completion-time filtering
    # keeps the short, a tight lag drops the long) trains on another distribution: not recommended
    default = default_config(w, n)
    if prompts:
        default = dataclasses.replace(default, prompts_per_step=prompts)
    d_result = next((r for c, r in table if c == default), None) or simulate(w, default, steps=steps, warmup=warmup)
    allowed = length_shift(d_result) + max_shift     # the default's own filters (all-equal groups) set the base
    eligible = [cr for cr in table if length_shift(cr[1]) <= allowed]
    # within 2% of the fastest eligible, the smallest lag (staleness costs learning, not throughput)
    top = eligible[0][1].admitted_tokens_per_s if eligible else 0.0
    near = [cr for cr in eligible if cr[1].admitted_tokens_per_s >= 0.98 * top]
    near.sort(key=lambda cr: (cr[0].max_policy_lag if cr[0].max_policy_lag >= 0 else 99, -cr[1].admitted_tokens_per_s))
    best_cfg, best = near[0] if near else (default, d_result)
    # the default stays unless another configuration is clearly faster (the simulation's own spread)
    if best.admitted_tokens_per_s < d_result.admitted_tokens_per_s * 1.05:
        best_cfg, best = default, d_result
    caps_best = capacities(w, best_cfg)
    out["candidates"] = [{"label": c.label(), "overrides": c.overrides(), "admitted_tokens_per_s":
                          r.admitted_tokens_per_s, "step_s": r.step_s, "utilisation": r.utilisation,
                          "queue_depth": r.queue_depth, "lag": r.lag_histogram,
                          "admitted_length_shift": length_shift(r), "eligible": length_shift(r) <= allowed}
                         for c, r in table]
    out["default"] = {"label": default.label(), "overrides": default.overrides(),
                      "predicted": _predicted(d_result)}
    out["recommended"] = {
        "label": best_cfg.label(), "config": dataclasses.asdict(best_cfg), "overrides": best_cfg.overrides(),
        "is_default": best_cfg == default, "predicted": _predicted(best),
        "speedup_over_default": best.admitted_tokens_per_s / d_result.admitted_tokens_per_s
        if d_result.admitted_tokens_per_s else None,
        "capacities": caps_best, "bound": bound(w, best_cfg, caps_best),
        "queue_bounds": queue_bounds(best_cfg, best),
        "how": ("every candidate simulated for "
                f"{steps} steps (median of 3 episode orders), admitted tokens/s over steps {warmup + 1}..{steps - 1}; "
                f"among those whose admitted episodes' mean length is within {100 * max_shift:.0f}% (beyond the "
                "default's own shift) of the launched ones', the fastest (within 2% of it the smallest lag) is "
                "recommended, the default kept unless "
                "another is >= 5% faster")}
    return out


def _predicted(r: SimResult) -> dict[str, Any]:
    return {"admitted_tokens_per_s": r.admitted_tokens_per_s, "step_s": r.step_s, "utilisation": r.utilisation,
            "queue_depth": r.queue_depth, "lag_histogram": r.lag_histogram, "admitted": r.admitted,
            "launched": r.launched}


def _size_for_target(w: Workload, measured: Config, target: float, headroom: float,
                     placements) -> tuple[int, int, dict]:
    """Ranks for a target admitted tokens/s: each rank keeps the measured per-rank load (prompts_per_step
    grows with the ranks); the capacity bound, not a simulation, picks the count; headroom keeps the
    bottleneck stage at most `headroom` utilised."""
    per_rank = measured.prompts_per_step / max(measured.rollout_ranks if measured.placement == "colocated"
                                               else measured.world_size, 1)
    tried = []
    for n in range(1, 4097):
        prompts = max(1, round(per_rank * n))
        best = 0.0
        for placement in placements:
            if placement == "colocated":
                cfg = dataclasses.replace(measured, placement="colocated", train_ranks=n, rollout_ranks=n,
                                          prompts_per_step=prompts, rollout_mode="sync")
                best = max(best, bound(w, cfg, capacities(w, cfg))["tokens_per_s"])
            elif n >= 2:
                for r in range(1, n):
                    cfg = dataclasses.replace(measured, placement="disaggregated", train_ranks=n - r, rollout_ranks=r,
                                              prompts_per_step=prompts, max_policy_lag=1)
                    best = max(best, bound(w, cfg, capacities(w, cfg))["tokens_per_s"])
        tried.append((n, best))
        if best * headroom >= target:
            return n, prompts, {"target_tokens_per_s": target, "ranks": n, "prompts_per_step": prompts,
                                "bound_tokens_per_s": best, "headroom": headroom,
                                "how": f"the smallest rank count whose capacity bound x headroom {headroom} reaches "
                                       f"the target, each rank keeping {per_rank:g} prompts per step"}
    raise ValueError(f"no rank count up to 4096 reaches {target} admitted tokens/s (bound at 4096: "
                     f"{tried[-1][1]:.0f}): the controller's per-step overhead limits it")


# ---------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", default=None, metavar="RUN_DIR",
                   help="an RL run directory: its ledger is the episode distribution, its metrics the stage times")
    p.add_argument("--measure", action="store_true",
                   help="run short benchmarks: engine step time by batch and context, the task's tools and sandbox "
                        "start, trainer tokens/s by micro-batch token budget (they replace the fitted models)")
    p.add_argument("--model", default=None, help="--measure: the HF model directory to benchmark (default: the run's)")
    p.add_argument("--ranks", type=int, default=None, help="plan for this many ranks (default: the run's)")
    p.add_argument("--nodes", type=int, default=None, help="plan for this many nodes of --ranks-per-node ranks")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--target-tokens-per-s", type=float, default=None, metavar="X",
                   help="the ranks and configuration that reach X admitted tokens/s")
    p.add_argument("--headroom", type=float, default=0.8, help="most utilisation of the bottleneck stage (target)")
    p.add_argument("--what-if", action="append", default=[], metavar="KEY=VALUE",
                   help="model_scale=K (parameters x K), context_scale=C (tokens per turn x C), tool_latency_s=S "
                        "(mean tool / environment wait), tool_scale=F")
    p.add_argument("--placements", default="colocated,disaggregated")
    p.add_argument("--steps", type=int, default=30, help="simulated steps per candidate")
    p.add_argument("--all", action="store_true", help="list every candidate simulated (default: the fastest "
                                                      f"{SHOWN}, the default, measured and recommended ones)")
    p.add_argument("--json", action="store_true")


def _parse_what_if(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--what-if {item!r}: expected KEY=VALUE (e.g. model_scale=4)")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--what-if {item!r}: {value!r} is not a number") from None
    return out


def main(args: argparse.Namespace) -> int:
    from hybridrl.cost.fit import workload_from_run
    from hybridrl.cost.records import read_run

    try:
        changes = _parse_what_if(args.what_if)
        if args.run_dir is None:
            raise ValueError("give a RUN_DIR: an RL run's directory, whose ledger is the episode distribution (a "
                             "few steps are enough: `hybridrl train RECIPE trainer.total_steps=5`)")
        measured = None
        rec = read_run(args.run_dir)
        w = workload_from_run(rec)
        if args.measure:
            from hybridrl.cost.measure import measure_into

            measured = measure_into(w, rec, model=args.model or rec.config.get("model", {}).get("path"))
        if changes:
            w = what_if(w, changes)
        placements = tuple(p.strip() for p in args.placements.split(",") if p.strip())
        if args.nodes:
            args.ranks = args.nodes * args.ranks_per_node
        out = plan(w, ranks=args.ranks, target=args.target_tokens_per_s, headroom=args.headroom,
                   placements=placements, steps=args.steps)
        if measured is not None:
            out["measurements"] = {k: v for k, v in measured.items() if k != "engine_rows"}
    except (FileNotFoundError, ValueError) as err:
        print(f"hybridrl plan: {err}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1, default=_json_default) if args.json else format_plan(out, args.all))
    return 0


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _rate(x: float) -> str:
    return "unbounded" if not math.isfinite(x) else f"{x:,.0f}"


SHOWN = 3      # candidates listed by default: the fastest few, and the default, measured and recommended ones


def shown_candidates(out: dict, all_rows: bool = False) -> list[dict]:
    """The candidate rows that matter (the table is sorted by admitted tokens/s): the SHOWN fastest and
    the default, measured and recommended configurations; every row with `all_rows`."""
    keep = {out["recommended"]["label"], out["default"]["label"], out["measured"]["label"]}
    return [c for i, c in enumerate(out["candidates"]) if all_rows or i < SHOWN or c["label"] in keep]


def format_plan(out: dict, all_rows: bool = False) -> str:
    lines = _format_measured(out) + _format_candidates(out, all_rows) + _format_recommended(out)
    wl = out["workload"]
    lines += ["", "derivations:", f"  engine: {wl['engine']['how']}", f"  trainer: {wl['trainer']['how']}"]
    lines += [f"  {k}: {v}" for k, v in wl["overheads"]["how"].items()]
    lines += [f"  note: {n}" for n in wl["notes"]]
    lines += ["", "what the planner cannot know:"] + [f"  - {c}" for c in out["cannot_know"]]
    return "\n".join(lines)


def _format_measured(out: dict) -> list[str]:
    m, wl = out["measured"], out["workload"]
    lines = [f"workload {wl['name']}: {wl['groups']} groups, {wl['episodes']} episodes, policy tokens per episode "
             f"mean {wl['policy_tokens']['mean']:.1f} (p90 {wl['policy_tokens']['p90']}), turns "
             f"{wl['turns']['mean']:.2f}, tool/env wait {wl['wait_s_per_episode']['mean']:.3f}s per episode",
             f"measured as {m['label']}: {m['admitted_tokens_per_s']:,.0f} admitted tokens/s, {m['step_s']:.3f}s "
             "per step", ""]
    for u in out.get("unreliable", []):
        lines.append(f"UNRELIABLE {u['model']} fit: {u['why']}")
    if out.get("unreliable"):
        lines += [f"  the figures below rest on {'these fits' if len(out['unreliable']) > 1 else 'it'}: read them as "
                  f"rough; to firm them up, {FIRM_UP}", ""]
    lines.append("stage capacities at the measured configuration (admitted tokens/s):")
    for stage, c in m["capacities"].items():
        lines.append(f"  C_{stage:<8} {_rate(c['tokens_per_s']):>10}   {c['how']}")
    b = m["bound"]
    lines += [f"  bound {_rate(b['tokens_per_s'])} tokens/s ({b['how']}); bottleneck: {b['bottleneck']}", ""]
    if "target" in out:
        t = out["target"]
        lines += [f"target {t['target_tokens_per_s']:,.0f} tokens/s: {t['ranks']} ranks, {t['prompts_per_step']} "
                  f"prompts per step ({t['how']})", ""]
    return lines


def _format_candidates(out: dict, all_rows: bool) -> list[str]:
    rows = shown_candidates(out, all_rows)
    tags = [("recommended", out["recommended"]["label"]), ("default", out["default"]["label"]),
            ("measured", out["measured"]["label"])]
    lines = [f"{'candidate':<52}{'tokens/s':>10}{'step s':>9}{'util roll/train':>17}{'queue':>7}{'length shift':>14}"]
    for c in rows:
        u = c["utilisation"]
        tag = ", ".join(name for name, label in tags if label == c["label"])
        lines.append(f"  {c['label']:<50}{c['admitted_tokens_per_s']:>10,.0f}{c['step_s']:>9.3f}"
                     f"{u['rollout']:>9.2f}/{u['train']:.2f}{c['queue_depth']:>7.1f}"
                     f"{100 * c['admitted_length_shift']:>12.1f}%" + ("" if c["eligible"] else " (biased)")
                     + (f"  <- {tag}" if tag else ""))
    hidden = len(out["candidates"]) - len(rows)
    if hidden:
        lines.append(f"  ({hidden} more candidate(s) simulated: --all lists them, --json gives every figure)")
    return lines


def _format_recommended(out: dict) -> list[str]:
    rec = out["recommended"]
    p = rec["predicted"]
    shaky = " (from an unreliable fit: see above)" if out.get("unreliable") else ""
    return ["", f"recommended: {rec['label']}" + (" (the default)" if rec["is_default"] else
                                                  f" ({rec['speedup_over_default']:.2f}x the default, "
                                                  f"{out['default']['label']})") + shaky,
            f"  run with: {' '.join(rec['overrides'])}",
            f"  predicted {p['admitted_tokens_per_s']:,.0f} admitted tokens/s, {p['step_s']:.3f}s per step; "
            f"utilisation rollout {p['utilisation']['rollout']:.2f}, train {p['utilisation']['train']:.2f}; "
            f"lag {p['lag_histogram']}",
            "  queue: " + ", ".join(f"{k} {v:g}" if isinstance(v, (int, float)) else f"{k} {v}"
                                    for k, v in rec["queue_bounds"].items() if k != "how"),
            f"  ({rec['queue_bounds']['how']})", f"  how: {rec['how']}"]
