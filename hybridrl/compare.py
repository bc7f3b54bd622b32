"""`hybridrl compare A B`: what differs between two runs: their configs, key by key, and a table of
their metrics (first and last value of each, validation accuracy by step).

Both are run directories (run.dir); each keeps its resolved config in config.json and its
metrics in metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hybridrl.telemetry.metrics import read_metrics

METRICS = ("val/accuracy", "val/accuracy_sampled", "reward/mean", "reward/accuracy", "kl", "train/entropy",
           "loss", "sft/loss", "episode/tool_calls", "episode/response_tokens", "time/step_s",
           "yield/tokens_per_s")


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_diff(a: Path, b: Path) -> list[tuple[str, Any, Any]]:
    """The keys whose values differ; a path under each run's own run.dir (the audit log, the kill switch,
    the environments' database: `${run.dir}/...` by default) differs only when its place in the run does;
    run.dir itself only when it is not the directory compared (the header names those)."""
    ca, cb = (flatten(json.loads((d / "config.json").read_text())) for d in (a, b))
    ra, rb = _relative_to_run(ca), _relative_to_run(cb)
    if all(Path(str(c.get("run.dir", ""))).resolve() == d.resolve() for c, d in ((ca, a), (cb, b))):
        ra, rb = {**ra, "run.dir": "(the directory compared)"}, {**rb, "run.dir": "(the directory compared)"}
    return [(k, ca.get(k, "(absent)"), cb.get(k, "(absent)")) for k in sorted(set(ca) | set(cb))
            if ra.get(k, "(absent)") != rb.get(k, "(absent)")]


def _relative_to_run(flat: dict[str, Any]) -> dict[str, Any]:
    """`flat` with every other value under run.dir written as `${run.dir}/REST` (run.dir itself kept)."""
    root = str(flat.get("run.dir") or "").rstrip("/")
    if not root:
        return flat
    return {k: ("${run.dir}" + v[len(root):] if k != "run.dir" and isinstance(v, str)
                and (v == root or v.startswith(root + "/")) else v) for k, v in flat.items()}


def metric_table(a: Path, b: Path) -> list[tuple[str, str, str]]:
    ra, rb = read_metrics(a), read_metrics(b)
    rows = []
    for key in METRICS:
        cells = []
        for rows_of in (ra, rb):
            values = [(r["step"], r[key]) for r in rows_of if isinstance(r.get(key), (int, float))]
            cells.append(f"{values[0][1]:.4g} -> {values[-1][1]:.4g} (step {values[-1][0]})" if values else "-")
        if cells != ["-", "-"]:
            rows.append((key, *cells))
    return rows


def compare_text(a: Path, b: Path) -> str:
    for d in (a, b):
        if not (d / "config.json").exists():
            raise FileNotFoundError(f"{d}: no config.json (a run directory: run.dir of a run)")
    diff = config_diff(a, b)
    lines = [f"A = {a}", f"B = {b}", "", f"config: {len(diff)} key(s) differ" + (":" if diff else "")]
    width = max((len(k) for k, _, _ in diff), default=0)
    lines += [f"  {k:{width}s}  A {va!r}  B {vb!r}" for k, va, vb in diff]
    table = metric_table(a, b)
    lines += ["", "metrics (first -> last):"]
    if table:
        w0 = max(len(r[0]) for r in table)
        w1 = max(len(r[1]) for r in table + [("", "A", "")])
        lines.append(f"  {'':{w0}s}  {'A':{w1}s}  B")
        lines += [f"  {k:{w0}s}  {x:{w1}s}  {y}" for k, x, y in table]
    else:
        lines.append("  none of the usual metrics in either run")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="a run directory")
    p.add_argument("b", metavar="B", help="another run directory")


def main(args: argparse.Namespace) -> int:
    try:
        print(compare_text(Path(args.a), Path(args.b)))
    except FileNotFoundError as err:
        print(f"hybridrl compare: {err}", file=sys.stderr)
        return 2
    return 0
