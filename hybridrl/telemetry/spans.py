"""The run's timeline as it happens: what each rank did, and when.

    <run.dir>/timeline/rank<R>-<pid>.jsonl   one JSON object per span, written when it ends:
        {"name", "track", "ts" (time.time() at its start), "dur" (seconds), "args" (small JSON)}

Two kinds of producer write here, each on its own track of the rank:

    controller   rank 0's RL loop: each step (from its top to the next step's), and inside it the
                 stages of `telemetry/timers.py: StageTimer` (sync, rollout, prep, train), validation,
                 the ledger's write (store) and the checkpoint
    phases       every rank's timed phases (`workers/modes.py: Phases`): the phases of a mode switch
                 (offload, publish, wake, probe, sleep, reload, ...), generation, the train passes, and
                 `wait:<phase>`, the time a rank waited for the others at a switch's arrival

What happens inside an episode (its turns, requests, tool calls, reward) is not written here: it travels
with the trajectory into the run ledger, each event with its wall-clock time (`data/trace.py`), and
`hybridrl inspect RUN --timeline` (`inspect/timeline.py`) joins the two. `episode_spans` turns those
events into spans and `nest` orders spans into a tree: the timeline and the OpenTelemetry traces
(`telemetry/otel.py`) share them. The controller keeps the open step's spans in memory as well
(`current_step`), for the traces.

A span costs one small unbuffered append to a file opened once (O_APPEND: a killed rank loses no line it
wrote), a few per step per rank. A process that never opened a log (`open_log`) records nothing: each
call is one check of a module global. The file is named by the process id as well as the rank, so a
restarted rank never interleaves with the one before it; the reader keeps what falls in the steps asked for.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from hybridrl.telemetry import live

TIMELINE_DIR = "timeline"


class SpanLog:
    """This process's span file."""

    def __init__(self, path: Path, rank: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.rank = path, rank
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._step: tuple[int, float] | None = None       # the open step: (number, start)
        self.step_spans: list[tuple[str, float, float]] = []    # the open step's controller spans so far

    def record(self, name: str, start: float, end: float, *, track: str, **args: Any) -> None:
        row = {"name": name, "track": track, "ts": start, "dur": max(0.0, end - start), "args": args}
        if track == "controller":
            self.step_spans.append((name, start, end))
        os.write(self._fd, (json.dumps(row, separators=(",", ":"), default=str) + "\n").encode())

    def begin_step(self, step: int) -> None:
        """The top of RL step `step`: the open step's span ends here."""
        now = time.time()
        self.end_step(now)
        self._step = (step, now)
        self.step_spans = []

    def end_step(self, now: float | None = None) -> None:
        if self._step is not None:
            step, start = self._step
            self.record("step", start, time.time() if now is None else now, track="controller", step=step)
            self._step = None

    def close(self) -> None:
        self.end_step()
        os.close(self._fd)


_LOG: SpanLog | None = None


def timeline_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / TIMELINE_DIR


def open_log(run_dir: str | Path, rank: int) -> SpanLog:
    """Record this process's spans under `run_dir` from now on (a process that runs several RL jobs in turn,
    a test's, moves to the newest one's directory)."""
    global _LOG
    path = timeline_dir(run_dir) / f"rank{rank}-{os.getpid()}.jsonl"
    if _LOG is None or _LOG.path != path:
        if _LOG is not None:
            _LOG.close()
        _LOG = SpanLog(path, rank)
    return _LOG


def record_phase(name: str, seconds: float, *, arrival_s: float = 0.0, **args: Any) -> None:
    """A rank's phase that ended now and lasted `seconds`, after `arrival_s` waiting for the other ranks."""
    if _LOG is None:
        return
    end = time.time()
    start = end - seconds
    if arrival_s > 0:
        _LOG.record(f"wait:{name}", start - arrival_s, start, track="phases")
    _LOG.record(name, start, end, track="phases", **args)


def current_step() -> tuple[int, float, list[tuple[str, float, float]]] | None:
    """The open step (number, start) and its controller spans so far (None when nothing records)."""
    if _LOG is None or _LOG._step is None:
        return None
    return (*_LOG._step, list(_LOG.step_spans))


def begin_step(step: int) -> None:
    if _LOG is not None:
        _LOG.begin_step(step)


def end_step() -> None:
    if _LOG is not None:
        _LOG.end_step()


@contextlib.contextmanager
def span(name: str, *, track: str = "controller", **args: Any) -> Iterator[None]:
    """Record the block as a span (also when it raises: the timeline shows where a step died); a span of
    the controller is its current phase meanwhile (`telemetry/live.py`)."""
    before = live.set_phase(name) if track == "controller" else None
    start = time.time()
    try:
        yield
    finally:
        if _LOG is not None:
            _LOG.record(name, start, time.time(), track=track, **args)
        if before is not None:
            live.set_phase(before)


def traced(name: str) -> Callable:
    """A function's every call as a span on the controller's track."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*a: Any, **kw: Any) -> Any:
            with span(name):
                return fn(*a, **kw)
        return call
    return wrap


def episode_spans(trace: list[dict], timings: dict) -> list[tuple[str, float, float, dict]]:
    """One trajectory's trace events -> (name, start, end, args): the episode, its turns, each request
    (with queued / prefill / decode), tool calls, environment steps and the reward. Events without a
    wall-clock time (a ledger written before they had one) give nothing."""
    timed = [e for e in trace if "at" in e]
    if not timed:
        return []
    out: list[tuple[str, float, float, dict]] = []
    turn_start: dict[int, float] = {}
    for e in timed:
        at, kind = e["at"], e["span"]
        if kind == "generate":
            start = at - e["total_s"]
            turn_start.setdefault(e["turn"], start)
            out.append(("generate", start, at, {"turn": e["turn"], "request": e["request_id"], "tokens": e["tokens"],
                                                "version": e["version"], "finish": e["finish"],
                                                "queued_s": e["queued_s"]}))
            t = start
            for part in ("queued", "prefill", "decode"):
                out.append((part, t, t + e[f"{part}_s"], {}))
                t += e[f"{part}_s"]
        elif kind == "action" and e.get("latency_s") is not None:
            out.append((f"tool:{e['tool']}", at - e["latency_s"], at, {"turn": e["turn"], "ok": e.get("ok")}))
        elif kind == "env_step":
            out.append(("env_step", at - e["seconds"], at, {"turn": e["turn"], "reward": e["reward"]}))
        elif kind == "reward":
            out.append(("reward", at - e["seconds"], at, {"total": e["total"]}))
    for e in timed:
        if e["span"] == "turn" and e["turn"] in turn_start:
            out.append((f"turn {e['turn']}", turn_start[e["turn"]], e["at"], {}))
    end = max(e["at"] for e in timed)
    start = min([s for _, s, _, _ in out] + [end - float(timings.get("total_s", 0.0))])
    return [("episode", start, end, {})] + out


def nest(spans: list[tuple[str, float, float, dict]]) -> list[tuple[str, float, float, dict, int, int]]:
    """Spans of one thread, ordered so that each nests in the one before it or follows it; a span that
    straddles its parent's end is cut there. Adds each span's depth and its parent's index (-1: none)."""
    out = []
    stack: list[tuple[float, int]] = []                  # (end, index) of the open spans
    for name, start, end, args in sorted(spans, key=lambda s: (s[1], -s[2])):
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack and end > stack[-1][0]:
            end, args = stack[-1][0], {**args, "cut_at_parent_end": True}
        out.append((name, start, end, args, len(stack), stack[-1][1] if stack else -1))
        stack.append((end, len(out) - 1))
    return out


def read_spans(run_dir: str | Path) -> list[dict]:
    """Every span of the run, each with its `rank` (from the file's name)."""
    out = []
    for path in sorted(timeline_dir(run_dir).glob("rank*-*.jsonl")):
        rank = int(path.name[4:].split("-", 1)[0])
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:            # a line cut short by a kill
                    continue
                out.append({**row, "rank": rank})
    return out
