"""Mode-switch cost of the hybrid worker over a few model sizes, against the copy floor.

    python benchmarks/mode_switch.py --out runs/bench/mode_switch [--sizes 1m,10m,100m] [--cycles 5]

For each size it builds a model with `hybridrl assets tiny-model` (cached in --cache): Qwen2 for
1m/10m/100m, a Qwen3-MoE for `moe` (8 experts, top-2; trained on 2 ranks with its experts split over
both, train.ep=2, so publication gathers each expert from the rank that holds it), runs `hybridrl
bench mode-switch` (each verify mode), and writes every JSON plus a table (table.md, summary.json).
Ratios are measured against the copy floor taken in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SIZES = {   # name: (architecture, tiny-model arguments)
    "1m": ("qwen2", ["--hidden", "128", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--intermediate", "384"]),
    "10m": ("qwen2", ["--hidden", "256", "--layers", "10", "--heads", "8", "--kv-heads", "4", "--intermediate",
                      "1024"]),
    "100m": ("qwen2", ["--hidden", "768", "--layers", "14", "--heads", "12", "--kv-heads", "4", "--intermediate",
                       "2048"]),
    "375m": ("qwen2", ["--hidden", "1024", "--layers", "32", "--heads", "16", "--kv-heads", "4", "--intermediate",
                       "2816"]),
    "moe": ("qwen3_moe", ["--hidden", "256", "--layers", "6", "--heads", "8", "--kv-heads", "4", "--intermediate",
                          "1024", "--experts", "8", "--experts-per-tok", "2", "--moe-intermediate", "384"]),
}
# how a size runs besides --tp: the MoE model on two ranks, its experts split over them
LAYOUT = {"moe": ["--nproc", "2", "train.ep=2"]}


def build(name: str, cache: Path) -> Path:
    arch, args = SIZES[name]
    # the shape in the name: other benchmarks keep models of the same size name but another shape in the same
    # cache (benchmarks/vs_trl.py's qwen2-100m has 12 layers, this one 14)
    out = cache / f"{arch}-{name}-{'-'.join(args[1::2])}"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "hybridrl", "assets", "tiny-model", "--arch", arch, "--out",
                        str(out), *args], check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench/mode_switch")
    ap.add_argument("--cache", default="runs/bench/models")
    ap.add_argument("--sizes", default="1m,10m,100m")
    ap.add_argument("--verify", default="structure,post_copy")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (size, verify), interleaved; medians reported")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--huge-pages", default="on",
                    help="host tensors on transparent huge pages (THP_MEM_ALLOC_ENABLE): on, off or on,off "
                         "(both, interleaved in the same run)")
    args = ap.parse_args()
    out, cache = Path(args.out), Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for repeat in range(args.repeats):          # interleaved: every (size, verify, pages) once per round
        for size in args.sizes.split(","):
            model = build(size, cache)
            for verify in args.verify.split(","):
                for pages in args.huge_pages.split(","):
                    path = out / f"{size}-{verify}-thp_{pages}-{repeat}.json"
                    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1" if pages == "on" else "0"}
                    subprocess.run([sys.executable, "-m", "hybridrl", "bench", "mode-switch", "--model", str(model),
                                    "--tp", str(args.tp), "--cycles", str(args.cycles), "--verify", verify,
                                    "--json", str(path), *LAYOUT.get(size, [])], check=True, env=env)
                    runs.setdefault((size, verify, pages), []).append(json.loads(path.read_text()))
    rows = []
    for (size, verify, pages), results in runs.items():
        med = statistics.median
        rows.append({"size": size, "params_m": round(results[0]["model_params"] / 1e6, 1), "verify": verify,
                     "huge_pages": pages, "runs": len(results),
                     **{f"{p}_s": round(med(r["phases"][p]["median_s"] for r in results), 4)
                        for p in results[0]["phases"]},
                     "switch_s": round(med(r["switch_s"] for r in results), 4),
                     "floor_s": round(med(r["copy_floor_s"] for r in results), 4),
                     "ratio_to_floor": round(med(r["ratio_to_floor"] for r in results), 2),
                     "ratios": [round(r["ratio_to_floor"], 2) for r in results],
                     "copy_gb_s": round(med(r["copy_bandwidth_bytes_per_s"] for r in results) / 1e9, 2),
                     "first_touch_gb_s": round(med(r["first_touch_write_bytes_per_s"] for r in results) / 1e9, 2),
                     "load_1m": [round(r["load_average_1m"], 1) for r in results]})
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    keys = list(rows[0])
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    (out / "table.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
