"""`hybridrl inspect RUN --timeline [--steps A-B] [--out trace.json]`: what each rank and each engine did
over the run's steps, as a Chrome / Perfetto trace (open it at ui.perfetto.dev or chrome://tracing) and a
PNG of the same.

Two records are joined (both written while the run lives):
  - the ranks' spans (`telemetry/spans.py`, <run.dir>/timeline/): rank 0's RL loop (each step, its
    stages, validation, the ledger's write, the checkpoint) and every rank's phases (mode-switch phases,
    generation, train passes, the waits at a switch's arrival);
  - the episodes' events in the run ledger (`data/trace.py`: each stamped with its wall-clock time): per
    trajectory the episode, its turns, each inference request split into queued / prefill / decode, tool
    calls, environment steps and the reward, on the track of the engine that ran it.

Tracks: process "rank R" has threads "controller" (rank 0 only) and "phases"; process "engine R" has one
thread per lane, episodes packed so that a lane never holds two at once. Spans on one thread nest (a span
that would straddle its parent's end, from clock rounding, is cut at that end and says so in its args).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrl.telemetry.spans import episode_spans, nest, read_spans

ENGINE_PID = 1000                  # engine R is process ENGINE_PID + R (ranks are 0..)
UNKNOWN_ENGINE = 999               # trajectories whose engine was not recorded (run outside a rollout side)
_TRACKS = {"controller": 1, "phases": 2}


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """'A-B' or 'A' -> (A, B); None -> None; anything else -> ValueError naming the form."""
    if not text:
        return None
    lo, _, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A-B or A (step numbers), e.g. --steps 2-5") from None
    if first > last:
        raise ValueError(f"--steps {text!r}: the first step is after the last")
    return first, last


def step_windows(run_spans: list[dict]) -> dict[int, tuple[float, float]]:
    """step -> (start, end) wall-clock, from rank 0's step spans (a step done again after a resume: its last)."""
    out: dict[int, tuple[float, float]] = {}
    for s in run_spans:
        if s["name"] == "step" and s["track"] == "controller":
            step = int(s["args"]["step"])
            if step not in out or s["ts"] >= out[step][0]:
                out[step] = (s["ts"], s["ts"] + s["dur"])
    return out


def _ledger_episodes(run_dir: Path, steps: tuple[int, int] | None) -> list[dict]:
    """The selected steps' trajectories: id, step, engine rank and spans (none without a ledger)."""
    from hybridrl.inspect.query import RunLedger

    try:
        ledger = RunLedger(run_dir)
    except FileNotFoundError:
        return []
    out = []
    for row in ledger.select():
        if steps is not None and not steps[0] <= row["step"] <= steps[1]:
            continue
        data = ledger.data_row(ledger.index_row(row["id"]))
        if data is None:                                       # deleted by retention
            continue
        found = episode_spans(data["trace"], data["timings"])
        if found:
            name, start, end, args = found[0]
            found[0] = (name, start, end, {**args, "trajectory": row["id"], "step": row["step"],
                                           "reward": row["reward"], "status": row["status"]})
            out.append({"engine": data["metadata"].get("engine_rank", UNKNOWN_ENGINE), "spans": found})
    return out


def _lanes(episodes: list[dict]) -> list[tuple[int, int, dict]]:
    """(engine, lane, episode): each engine's episodes packed into lanes that never hold two at once."""
    out, ends = [], {}
    for ep in sorted(episodes, key=lambda e: e["spans"][0][1]):
        lanes = ends.setdefault(ep["engine"], [])
        start, end = ep["spans"][0][1], ep["spans"][0][2]
        lane = next((i for i, e in enumerate(lanes) if e <= start), len(lanes))
        lanes[lane:lane + 1] = [end]
        out.append((ep["engine"], lane, ep))
    return out


def build_trace(run_dir: str | Path, steps: tuple[int, int] | None = None) -> dict:
    """The Chrome trace-event JSON of the run (its steps `steps`, inclusive; all when None)."""
    run_dir = Path(run_dir)
    run_spans = read_spans(run_dir)
    if not run_spans:
        raise FileNotFoundError(f"{run_dir} has no timeline ({run_dir / 'timeline'} is empty or missing): the run "
                                "predates it, or it was not an RL run")
    windows = step_windows(run_spans)
    lo, hi = float("-inf"), float("inf")
    if steps is not None:
        missing = [s for s in range(steps[0], steps[1] + 1) if s not in windows]
        if missing:
            raise KeyError(f"steps {missing} are not in the run's timeline (it has steps "
                           f"{min(windows, default=0)}-{max(windows, default=0)})")
        lo, hi = windows[steps[0]][0], windows[steps[1]][1]
    threads: dict[tuple[int, int], list] = {}
    for s in run_spans:
        start, end = max(s["ts"], lo), min(s["ts"] + s["dur"], hi)
        if end < start or (steps is not None and (s["ts"] >= hi or s["ts"] + s["dur"] <= lo)):
            continue
        threads.setdefault((s["rank"], _TRACKS.get(s["track"], 3)), []).append((s["name"], start, end, s["args"]))
    for engine, lane, ep in _lanes(_ledger_episodes(run_dir, steps)):
        threads.setdefault((ENGINE_PID + engine, lane + 1), []).extend(ep["spans"])
    return _events(threads, windows, steps)


def _events(threads: dict[tuple[int, int], list], windows: dict, steps: tuple[int, int] | None) -> dict:
    t0 = min(s[1] for spans in threads.values() for s in spans)
    events: list[dict[str, Any]] = []
    for pid in sorted({p for p, _ in threads}):
        name = (f"rank {pid}" if pid < ENGINE_PID else "episodes (engine not recorded)"
                if pid == ENGINE_PID + UNKNOWN_ENGINE else f"engine {pid - ENGINE_PID} (episodes)")
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0, "args": {"name": name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0, "args": {"sort_index": pid}})
    for (pid, tid), spans in sorted(threads.items()):
        label = ({v: k for k, v in _TRACKS.items()}.get(tid, "other") if pid < ENGINE_PID else f"lane {tid - 1}")
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": label}})
        for name, start, end, args, _, _ in nest(spans):
            ts, end_us = round((start - t0) * 1e6, 3), round((end - t0) * 1e6, 3)     # rounded ends keep nesting
            events.append({"name": name, "cat": _category(name), "ph": "X", "pid": pid, "tid": tid,
                           "ts": ts, "dur": round(end_us - ts, 3), "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_s": t0, "steps": list(steps) if steps else sorted(windows)}}


_CATEGORIES = {"step": "step", "sync": "switch", "rollout": "rollout", "prep": "train", "train": "train",
               "validate": "validate", "store": "store", "checkpoint": "checkpoint", "generate": "rollout",
               "queued": "rollout", "prefill": "rollout", "decode": "rollout", "episode": "episode",
               "reward": "reward", "reward_model": "reward", "env_step": "env", "critic_train": "train"}


def _category(name: str) -> str:
    if name.startswith("wait:"):
        return "wait"
    if name.startswith("tool:"):
        return "tool"
    if name.startswith("turn "):
        return "turn"
    return _CATEGORIES.get(name, "switch")


def write_timeline(run_dir: str | Path, out: str | Path | None = None,
                   steps: tuple[int, int] | None = None) -> tuple[Path, Path]:
    """The trace (default <run.dir>/timeline.json) and its picture beside it (.png; needs matplotlib)."""
    from hybridrl.inspect.timeline_plot import draw

    if not has_matplotlib():
        raise FileNotFoundError("the timeline's picture needs matplotlib: pip install 'hybridrl[plot]'")

    trace = build_trace(run_dir, steps)
    path = Path(out) if out else Path(run_dir) / "timeline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace, separators=(",", ":")))
    png = path.with_suffix(".png")
    draw(trace, png, title=f"{Path(run_dir).name}: steps " + _steps_text(trace["otherData"]["steps"]))
    return path, png


def has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _steps_text(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "-"
