"""What the sandbox's new defences cost: a sandbox started and a trivial call run in it, before
(the package at another git revision) and after (this checkout), side by side in one run.

    python benchmarks/sandbox.py --json runs/bench/sandbox.json [--before REV] [--repeats 6] [--calls 20]

The package at REV (default: the merge base with main) is unpacked into a temporary directory.
Each repeat starts one fresh process per variant, interleaved (before, after, after+audit, then
the next repeat in the other order), and each process times, on a pool with no warm sandboxes
(every call starts its sandbox: boot, pid 1, mounts, the cgroup, the syscall filter, the exec):

  - `start_s`: `SandboxPool.start()` (its isolation probe, and after: the cgroup and filter set-up);
  - `call_s`: `pool.run("pass")`, `--calls` times in a row: sandbox start + a trivial call + its end;
  - `cpu_s`: the CPU time of that call, the pool's own and its sandbox's processes' (boot reaps pid 1,
    which reaps the tool: RUSAGE_CHILDREN holds all three), which a loaded machine inflates far less
    than wall time.

"after+audit" is the same code with the run's audit log on (one chained record per call). The
report gives medians and the interquartile spread per variant and the after / before ratios of the
median call time (the target: at most 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r"""
import asyncio, json, resource, sys, time
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.pool import SandboxPool

def main(calls, audit):
    fields = dict(pool_size=1, warm=0, timeout_s=60.0)
    if "audit_log" in ToolsConfig.__dataclass_fields__:
        fields["audit_log"] = audit
    async def go():
        pool = SandboxPool(ToolsConfig(**fields))
        t = time.perf_counter()
        await pool.start()
        start = time.perf_counter() - t
        times, cpu = [], []
        for _ in range(calls):
            c0 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
            t = time.perf_counter()
            r = await pool.run("pass")
            times.append(time.perf_counter() - t)
            c1 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
            cpu.append(sum(b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime for a, b in zip(c0, c1)))
            assert r.ok, (r.stderr, r.setup_error)
        mode = pool.mode
        await pool.close()
        return {"mode": mode, "start_s": start, "call_s": times, "cpu_s": cpu}
    print(json.dumps(asyncio.run(go())))

main(int(sys.argv[1]), sys.argv[2])
"""


def unpack(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", "--format=tar", rev, "hybridrl"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    tar = into / "before.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(into / "before")
    return into / "before"


def measure(package_root: Path, calls: int, audit: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(calls), audit], cwd="/", env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"benchmarks/sandbox.py: a measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median_ms": 1000 * statistics.median(values), "p25_ms": 1000 * q[0], "p75_ms": 1000 * q[2],
            "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--before", default=None, help="git revision of the code before (default: merge base with "
                                                       "main)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    before_rev = args.before or subprocess.run(["git", "merge-base", "HEAD", "main"], cwd=ROOT, capture_output=True,
                                               text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="hybridrl-bench-sandbox-") as tmp:
        tmp = Path(tmp)
        before = unpack(before_rev, tmp)
        variants = {"before": (before, ""), "after": (ROOT, ""), "after+audit": (ROOT, str(tmp / "audit.jsonl"))}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for rep in range(args.repeats):
            order = list(variants) if rep % 2 == 0 else list(reversed(variants))
            for name in order:
                root, audit = variants[name]
                runs[name].append(measure(root, args.calls, audit))
                print(f"repeat {rep + 1}/{args.repeats} {name}: median call "
                      f"{1000 * statistics.median(runs[name][-1]['call_s']):.1f} ms", file=sys.stderr)
    report = {"before_rev": before_rev, "repeats": args.repeats, "calls_per_repeat": args.calls,
              "isolation": {name: sorted({r["mode"] for r in rs}) for name, rs in runs.items()},
              "start": {name: summary([r["start_s"] for r in rs]) for name, rs in runs.items()},
              "call": {name: summary([t for r in rs for t in r["call_s"]]) for name, rs in runs.items()},
              "cpu": {name: summary([t for r in rs for t in r["cpu_s"]]) for name, rs in runs.items()},
              "load_average": os.getloadavg()}
    for what in ("call", "cpu"):
        base = report[what]["before"]["median_ms"]
        report[f"ratio_{what}"] = {name: report[what][name]["median_ms"] / base for name in ("after", "after+audit")}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
