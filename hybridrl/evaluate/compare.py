"""A suite's results across a run's checkpoints: a table, a PNG and the points the run's HTML page draws.

The results are the JSON files of `<run.dir>/eval/<suite>/` (written by `hybridrl eval --run` and by
the in-loop evaluation, `trainer.eval_suite`): one per step. Only results of the suite's current
hash are compared (a result of another version of the suite says so and is left out).
"""

from __future__ import annotations

import json
from pathlib import Path


def results_of(eval_dir: Path, suite_hash: str | None = None) -> list[dict]:
    """The suite results in `eval_dir` (one suite's directory) that have a step, by step; with
    `suite_hash`, only those of that hash."""
    out = []
    for path in sorted(eval_dir.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if not isinstance(result, dict) or "metrics" not in result:
            continue
        if result.get("model", {}).get("step") is None:
            continue
        if suite_hash is not None and result["suite"]["hash"] != suite_hash:
            continue
        out.append(result)
    return sorted(out, key=lambda r: (r["model"]["step"], r.get("written_at", 0)))


def curves(results: list[dict]) -> dict[str, list[list[float]]]:
    """'{sampling} accuracy' / '{sampling} pass@k' -> [[step, value], ...] (one point per step: the newest)."""
    by_step = {r["model"]["step"]: r for r in results}
    out: dict[str, list[list[float]]] = {}
    for step, result in sorted(by_step.items()):
        for sampling, values in result["metrics"]["sampling"].items():
            for key, value in values.items():
                if key == "accuracy" or key.startswith("pass@"):
                    out.setdefault(f"{sampling} {key}", []).append([step, float(value)])
    return out


def table(results: list[dict]) -> str:
    """One line per result: step, and each sampling's accuracy and pass@k."""
    if not results:
        return "(no results)"
    keys = list(curves(results))
    head = f"{'step':>6}  {'model':<16}" + "".join(f"{k:>18}" for k in keys)
    lines = [head]
    for r in results:
        values = {f"{s} {k}": v for s, vs in r["metrics"]["sampling"].items() for k, v in vs.items()}
        lines.append(f"{r['model']['step']:>6}  {r['label']:<16}"
                     + "".join(f"{100 * values[k]:>17.1f}%" if k in values else f"{'-':>18}" for k in keys))
    return "\n".join(lines)


def plot(results: list[dict], out: Path, *, title: str, dpi: int = 100) -> Path:
    """Accuracy (and pass@k) against the step, one line per sampling and metric (matplotlib, Agg)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("hybridrl eval --compare: matplotlib is not installed: pip install 'hybridrl[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = curves(results)
    if not lines:
        raise ValueError("no results with a step to compare")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), dpi=dpi, squeeze=False)
    acc, passk = axes[0]
    for name, points in lines.items():
        ax = acc if name.endswith(" accuracy") else passk
        steps, values = [p[0] for p in points], [100 * p[1] for p in points]
        ax.plot(steps, values, marker="o", markersize=4, label=name)
    for ax, what in ((acc, "accuracy (%)"), (passk, "pass@k (%)")):
        ax.set_xlabel("step")
        ax.set_ylabel(what)
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no sampling with several samples", ha="center", transform=ax.transAxes)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out
