"""The timeline's picture (matplotlib, no display): one row per thread of the trace, each span a bar,
nested spans drawn thinner on top of their parents, coloured by category."""

from __future__ import annotations

from pathlib import Path

COLOURS = {"step": "#dddddd", "rollout": "#4caf50", "train": "#1f77b4", "switch": "#ff9800", "wait": "#9e9e9e",
           "validate": "#9c27b0", "store": "#795548", "checkpoint": "#d62728", "episode": "#c8e6c9",
           "turn": "#81c784", "tool": "#e91e63", "env": "#00bcd4", "reward": "#ffc107"}


def rows_of(trace: dict) -> list[tuple[int, int, str]]:
    """(pid, tid, label) of every thread, in the trace's order."""
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    return [(e["pid"], e["tid"], f"{procs[e['pid']]} / {e['args']['name']}")
            for e in trace["traceEvents"] if e["name"] == "thread_name"]


def draw(trace: dict, out: str | Path, *, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = rows_of(trace)
    y_of = {(pid, tid): len(rows) - 1 - i for i, (pid, tid, _) in enumerate(rows)}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.42 * len(rows)))
    depth: dict[tuple, list[float]] = {}
    used = set()
    for e in spans:                                  # already nested per thread, parents first
        key = (e["pid"], e["tid"])
        ends = depth.setdefault(key, [])
        while ends and ends[-1] <= e["ts"]:
            ends.pop()
        level = len(ends)
        ends.append(e["ts"] + e["dur"])
        height = 0.8 * 0.72 ** level
        colour = COLOURS.get(e["cat"], "#607d8b")
        used.add(e["cat"])
        ax.broken_barh([(e["ts"] / 1e6, max(e["dur"], 1.0) / 1e6)], (y_of[key] - height / 2, height),
                       facecolors=colour, edgecolors="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for _, _, label in reversed(rows)], fontsize=8)
    ax.set_xlabel("seconds since the first span")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=COLOURS.get(c, "#607d8b"), label=c) for c in sorted(used)], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = Path(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
