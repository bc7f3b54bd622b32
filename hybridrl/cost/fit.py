"""A `Workload` from what a run recorded (its ledger and metrics), or from episodes measured in process.

The stage models are fitted to the run's own step rows (`workload.fit_engine`, `fit_trainer`);
the fixed costs are medians over the steps; then the engine model is calibrated once: the measured
configuration is simulated and `rollout_factor` set so that its simulated rollout equals the measured
median T_rollout (what the engine model leaves out: the agent loop's own work, scheduling, the host).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Sequence

from hybridrl.cost.records import RunRecords
from hybridrl.cost.workload import (EngineModel, EpisodeShape, MeasuredConfig, Overheads, TrainerModel, Workload,
                                    fit_engine, fit_trainer, median, shape_from_counts, shape_of)

WARMUP = 2


def measured_config(config: dict, world_size: int) -> MeasuredConfig:
    t, a, p = config.get("trainer", {}), config.get("algo", {}), config.get("placement", {})
    agent = config.get("agent", {})
    disagg = p.get("mode") == "disaggregated"
    return MeasuredConfig(placement=p.get("mode", "colocated"), world_size=world_size,
                          rollout_ranks=int(p.get("rollout_ranks", 1)) if disagg else world_size,
                          rollout_mode=t.get("rollout_mode", "sync"), oversample=float(t.get("oversample", 1.0)),
                          max_policy_lag=int(a.get("max_policy_lag", -1)),
                          prompts_per_step=int(t.get("prompts_per_step", 1)), group_size=int(t.get("group_size", 1)),
                          max_concurrent=int(agent.get("max_concurrent_episodes", 64)),
                          drop_truncated=bool(a.get("drop_truncated", True)),
                          drop_all_equal_groups=bool(a.get("drop_all_equal_groups", True)))


def throughput_window(rows: Sequence[dict], warmup: int = WARMUP) -> dict[str, float]:
    """Admitted tokens/s of steps (warmup, last): their tokens over the wall time between their rows
    (`time/logged_at`), so everything between steps counts. The last step's row waits for the final
    validation, so it is left out."""
    steps = sorted((r for r in rows if r["step"] > 0 and r.get("time/logged_at")), key=lambda r: r["step"])
    if len(steps) < 3:
        raise ValueError(f"{len(steps)} step rows with time/logged_at: a throughput needs at least 3")
    lo = min(warmup, len(steps) - 2)
    window = steps[lo:len(steps) - 1]
    wall = window[-1]["time/logged_at"] - steps[lo - 1]["time/logged_at"] if lo >= 1 else 0.0
    if lo < 1 or wall <= 0:
        raise ValueError("the throughput window is empty (too few steps)")
    tokens = sum(float(r.get("tokens/admitted") or 0) for r in window)
    return {"admitted_tokens_per_s": tokens / wall, "step_s": wall / len(window), "steps": len(window),
            "first_step": window[0]["step"], "last_step": window[-1]["step"], "wall_s": wall,
            "rollout_s": statistics.median(float(r.get("time/T_rollout") or 0) for r in window),
            "train_s": statistics.median(float(r.get("time/T_train") or 0) for r in window)}


def _checkpoint_s(marks: list[dict]) -> float:
    spans = [b["at"] - a["at"] for a, b in zip(marks, marks[1:])
             if a["mark"] == "checkpoint" and b["mark"] == "checkpoint_end"]
    return statistics.median(spans) if spans else 0.0


def _overheads(rows: list[dict], config: dict, disagg: bool, marks: list[dict] | None = None) -> Overheads:
    t = config.get("trainer", {})
    every_ckpt, every_val = int(t.get("checkpoint_every", 0) or 0), int(t.get("validate_every", 0) or 0)
    steps = sorted((r for r in rows if r["step"] > 0), key=lambda r: r["step"])
    by_step = {r["step"]: r for r in steps}
    clean = []
    for r in steps:
        prev = by_step.get(r["step"] - 1)
        busy = lambda s: (every_ckpt and s % every_ckpt == 0) or r.get("val/seconds") is not None  # noqa: E731
        if prev is None or not r.get("time/logged_at") or not prev.get("time/logged_at") or busy(r["step"] - 1) \
                or r.get("val/seconds") is not None:
            continue
        gap = r["time/logged_at"] - prev["time/logged_at"]
        timed = sum(float(r.get(f"time/T_{s}") or 0) for s in ("sync", "rollout", "prep", "train", "store"))
        clean.append(max(0.0, gap - timed))
    sync = median(steps, "time/T_sync")
    ov = Overheads(
        sync_s=0.0 if disagg else sync,
        publish_s=sync if disagg else max(sync, median(steps, "switch/publish_s")),
        prep_s=median(steps, "time/T_prep"), store_s=median(steps, "time/T_store"),
        controller_s=statistics.median(clean) if clean else 0.0,
        validation_s=median(rows, "val/seconds"), validate_every=every_val,
        checkpoint_s=_checkpoint_s(marks or []), checkpoint_every=every_ckpt)
    ov.how = {"sync_s": "median time/T_sync (the colocated mode switches, publication included)",
              "publish_s": ("median time/T_sync (disaggregated: the publication to the rollout ranks)" if disagg else
                            "not measured (a colocated run): taken as the colocated switch, median time/T_sync, "
                            "which moves the same weights (an in-place publication alone, switch/publish_s, is "
                            "far cheaper than a broadcast to other processes)"),
              "checkpoint_s": f"median checkpoint span on the run's clock, every {every_ckpt} steps",
              "prep_s": "median time/T_prep", "store_s": "median time/T_store",
              "controller_s": f"median over {len(clean)} steps without validation or checkpoint of the wall time "
                              "between consecutive rows minus their timed stages",
              "validation_s": f"median val/seconds, every {every_val} steps"}
    return ov


def workload_from_run(rec: RunRecords, *, calibrate: bool = True) -> Workload:
    """The episode distribution and stage models of a run directory (its ledger and metrics)."""
    if not rec.episodes:
        raise ValueError(f"{rec.run_dir}: the run has no ledger trajectories (store.enabled=false?): the planner "
                         "needs the episode distribution; use --measure")
    mc = measured_config(rec.config, rec.world_size)
    disagg = mc.placement == "disaggregated"
    groups, untraced = _groups(rec)
    if not any(e.policy_tokens for g in groups.values() for e in g):
        raise ValueError(f"{rec.run_dir}: the ledger's training episodes hold no policy tokens (every episode failed "
                         "before the model answered? see `hybridrl inspect RUN_DIR`): there is no workload to plan")
    rows = rec.step_rows()
    native = rec.config.get("rollout", {}).get("native", {})
    engine = fit_engine(rows, ranks=mc.rollout_ranks, max_batch=int(native.get("max_num_seqs", 64)))
    trainer = fit_trainer(rows, ranks=mc.world_size - (mc.rollout_ranks if disagg else 0))
    w = Workload(groups=list(groups.values()), engine=engine, trainer=trainer,
                 overheads=_overheads(rec.rows, rec.config, disagg, rec.marks), measured=mc, name=str(rec.run_dir))
    try:
        tw = throughput_window(rec.rows)
        w.measured_step_s, w.measured_admitted_tokens_per_s = tw["step_s"], tw["admitted_tokens_per_s"]
        w.measured_rollout_s = tw["rollout_s"]
    except ValueError as err:
        w.notes.append(f"no measured throughput: {err}")
        w.measured_rollout_s = median(rows, "time/T_rollout")
    if untraced:
        w.notes.append(f"{untraced} episode(s) have no per-turn trace (task.agent: the gateway's episodes): their "
                       "turns come from the ledger's counts, policy tokens split evenly, the seconds outside "
                       "generation and the verifier taken as the waits between turns")
    if rec.pruned_steps:
        w.notes.append(f"{len(rec.pruned_steps)} step(s) of the ledger were deleted by retention: their episodes "
                       "are not in the distribution")
    if calibrate and not disagg:
        calibrate_rollout(w, steps=len(rows), target=_mean_of(rows, "time/T_rollout"), rows=rows)
    return w


def _groups(rec: RunRecords) -> tuple[dict[str, list[EpisodeShape]], int]:
    """The training episodes' shapes by group, and how many had no per-turn trace (shaped from counts)."""
    groups: dict[str, list[EpisodeShape]] = defaultdict(list)
    untraced = 0
    for e in rec.episodes:
        if e.step <= 0:
            continue
        if e.turn_events or not e.policy_tokens:
            shape = shape_of(e.turn_events, e.prompt_tokens, e.timings, e.reward, e.status, e.task_id,
                             e.status == "truncated")
        else:
            untraced += 1
            shape = shape_from_counts(prompt_tokens=e.prompt_tokens, policy_tokens=e.policy_tokens,
                                      response_tokens=e.response_tokens, turns=e.turns, timings=e.timings,
                                      reward=e.reward, status=e.status, task_id=e.task_id,
                                      truncated=e.status == "truncated")
        groups[e.group_id].append(shape)
    return groups, untraced


def workload_from_episodes(groups: list[list[EpisodeShape]], rows: list[dict], mc: MeasuredConfig, *,
                           max_batch: int, name: str, calibrate: bool = True) -> Workload:
    """A workload measured in process (benchmarks: a scripted engine, a simulated update): `rows` are
    per-step dicts with the same keys as metrics rows (engine/*, time/T_*, tokens/admitted, time/logged_at)."""
    engine = fit_engine(rows, ranks=mc.rollout_ranks, max_batch=max_batch)
    trainer = fit_trainer(rows, ranks=mc.world_size)
    ov = _overheads(rows, {"trainer": {}}, mc.placement == "disaggregated")
    w = Workload(groups=groups, engine=engine, trainer=trainer, overheads=ov, measured=mc, name=name)
    tw = throughput_window(rows)
    w.measured_step_s, w.measured_admitted_tokens_per_s, w.measured_rollout_s = (
        tw["step_s"], tw["admitted_tokens_per_s"], tw["rollout_s"])
    if calibrate:
        calibrate_rollout(w, steps=len(rows), target=_mean_of(rows, "time/T_rollout"), rows=rows)
    return w


def measured_as_config(w: Workload) -> Any:
    from hybridrl.cost.simulate import Config

    m = w.measured
    disagg = m.placement == "disaggregated"
    return Config(placement=m.placement, train_ranks=m.world_size - (m.rollout_ranks if disagg else 0),
                  rollout_ranks=m.rollout_ranks, rollout_mode=m.rollout_mode, oversample=m.oversample,
                  max_policy_lag=m.max_policy_lag, prompts_per_step=m.prompts_per_step, group_size=m.group_size,
                  max_concurrent=m.max_concurrent, drop_truncated=m.drop_truncated,
                  drop_all_equal_groups=m.drop_all_equal_groups)


def _mean_of(rows: Sequence[dict], key: str) -> float:
    xs = [float(r[key]) for r in rows if r["step"] > 0 and r.get(key) is not None]
    return statistics.fmean(xs) if xs else 0.0


def calibrate_rollout(w: Workload, *, steps: int, target: float, rows: Sequence[dict] | None = None) -> None:
    """Calibrate `rollout_factor` and `launch_s` on a replay of the measured configuration (the measured
    groups in their order). For each launch cost on a grid, secant steps on the factor match the
    measured mean T_rollout; the pair whose replay is closest to the measured rollout of every step is
    kept. A short step (no straggler) is mostly launch cost, a long one mostly engine steps: the steps
    tell the two apart."""
    from hybridrl.cost.simulate import Simulation

    if target <= 0 or steps < 1:
        return
    cfg = measured_as_config(w)
    measured = [float(r["time/T_rollout"]) for r in sorted(rows or [], key=lambda r: r["step"])
                if r["step"] > 0 and r.get("time/T_rollout") is not None][:steps]

    def replay(f: float, launch: float) -> list[float]:
        w.rollout_factor, w.launch_s = f, launch
        return [s["rollout_s"] for s in Simulation(w, cfg, seed=None).run(steps, WARMUP).steps]

    best = None
    for launch in (0.0, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016):
        f = 1.0
        got = statistics.fmean(replay(f, launch))
        for _ in range(6):
            if got <= 0 or abs(got - target) / target < 0.01:
                break
            f = max(0.05, f * target / got)
            got = statistics.fmean(replay(f, launch))
        sim = replay(f, launch)
        err = (sum((a - b) ** 2 for a, b in zip(sim, measured)) if measured else 0.0) + (got - target) ** 2
        if best is None or err < best[0] - 1e-12:
            best = (err, f, launch, got)
        if not measured:
            break
    _, f, launch, got = best
    w.rollout_factor, w.launch_s = f, launch
    w.notes.append(f"rollout_factor {f:.3f}, launch_s {launch * 1e3:.1f} ms: the replay of the measured configuration "
                   f"closest to its per-step rollouts (mean {got:.3f}s, measured {target:.3f}s)")
