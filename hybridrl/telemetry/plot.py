"""`hybridrl plot RUN [RUN ...] [--out FILE.png]`: a run's curves as one PNG, several runs overlaid.

Panels, each drawn when some run logged it: reward (mean), validation accuracy (greedy, and SFT's
sampled accuracy), KL, entropy, loss (RL or SFT) and the stage times of every step (rollout,
reward, prep, train, sync). Read from each run's metrics.jsonl; matplotlib (the `plot` extra) is
imported only here, with the Agg backend (no display needed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridrl.telemetry.metrics import read_metrics

PANELS = (  # title, [(metric, label)]
    ("reward", [("reward/mean", "mean reward")]),
    ("validation accuracy", [("val/accuracy", "greedy"), ("val/accuracy_sampled", "sampled")]),
    ("KL", [("kl", "kl")]),
    ("entropy", [("train/entropy", "entropy")]),
    ("loss", [("loss", "RL loss"), ("sft/loss", "SFT loss")]),
)
STAGES = ("rollout", "reward", "prep", "train", "sync")


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [float(p[1]) for p in points]


def plot_runs(run_dirs: list[Path], out: Path, *, width_px: int = 1500, dpi: int = 100) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("hybridrl plot: matplotlib is not installed: pip install 'hybridrl[plot]' "
                         "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_metrics(d) for d in run_dirs}
    empty = [d for d, rows in runs.items() if not rows]
    if empty:
        raise FileNotFoundError(f"{empty[0]}: no metrics.jsonl rows (a run directory: run.dir of a run)")
    panels = [(title, keys) for title, keys in PANELS
              if any(series(rows, k)[0] for rows in runs.values() for k, _ in keys)]
    has_stages = any(series(rows, "time/T_rollout")[0] for rows in runs.values())
    count = len(panels) + (len(runs) if has_stages else 0)
    cols = 3
    nrows = -(-count // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(width_px / dpi, 3.2 * nrows), dpi=dpi, squeeze=False)
    flat = list(axes.flat)
    label = (lambda d: Path(d).name) if len({Path(d).name for d in runs}) == len(runs) else str
    for ax, (title, keys) in zip(flat, panels):
        for d, rows in runs.items():
            for key, name in keys:
                steps, values = series(rows, key)
                if steps:
                    ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3,
                            label=f"{label(d)}: {name}" if len(runs) > 1 or len(keys) > 1 else name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    used = len(panels)
    if has_stages:
        for d, rows in runs.items():
            ax = flat[used]
            used += 1
            bottom = None
            for stage in STAGES:
                steps, values = series(rows, f"time/T_{stage}")
                if not steps:
                    continue
                ax.bar(steps, values, bottom=bottom, label=stage)
                bottom = values if bottom is None else [a + b for a, b in zip(bottom, values)]
            ax.set_title(f"stage times (s): {label(d)}")
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
    for ax in flat[used:]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (run.dir); several are overlaid")
    p.add_argument("--out", default=None, help="PNG to write (default: RUN/curves.png of the first run)")
    p.add_argument("--width", type=int, default=1500, help="image width in pixels (default 1500)")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(args.runs[0]) / "curves.png"
    try:
        path = plot_runs([Path(r) for r in args.runs], out, width_px=args.width)
    except FileNotFoundError as err:
        print(f"hybridrl plot: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
