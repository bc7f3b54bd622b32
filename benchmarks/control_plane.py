"""The control plane alone at N ranks: per-call overhead, store requests, failure-to-exit times.

    python benchmarks/control_plane.py --json runs/bench/control_plane.json [--ranks 8,32,128] [--calls 40]
        [--repeats 2] [--base OTHER_CHECKOUT]

No model and no data plane: N lightweight processes (forked from one launcher that imported torch
and hybridrl, so they share its pages) run the real control plane - `WorkerGroup.call` on rank 0,
`serve()` on the others, a `Watchdog` on every rank - over a real TCPStore hosted by a separate
process, as torchrun's agent hosts it. Ranks are grouped into simulated nodes of
`--ranks-per-node` (each process reports its node as its hostname), so ranks on other nodes are
seen through heartbeats only, as on a cluster. Three launches per N:

  calls   warm-up calls, then `--calls` timed calls of each kind, alternating: `noop` (every rank
          runs it, rank 0's output comes back) and `echo` (every rank returns a small object);
          then an idle pause (heartbeats only); then `group.abort()` with every worker idle
  raise   a call in which every worker is busy (sleeping) and the last rank raises after 0.5 s
  kill    a call in which every worker is busy and the launcher SIGKILLs every rank of the last node
(in both, rank 0's own share of the call returns at once: the controller waits for the others)

Reported per N (medians over repeats): per-call overhead (median and p90 of each call kind),
store requests per call (client API calls counted in every rank: a blocking `get` is one) and the
store's request rate during calls and while idle, the time from an abort / a raise / a death to
the exit of every rank, whether the error named what it must, and the memory (USS) per process.
Each quantity's growth is reported as its ratio to the smallest N. With `--base`, another
checkout's `hybridrl` package runs the same launches, interleaved with this one's
(base/head/head/base...), so that the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ("set", "get", "check", "add", "delete_key", "wait", "multi_get", "multi_set", "compare_set",
       "num_keys", "queue_push", "queue_pop")


# ------------------------------------------------------------------------------------ one launch

class CountingStore:
    """A store client that counts its calls in shared memory (slot: rank x {main, clone}); with
    `latency` (a dict), also the longest request of each kind on this connection, in seconds."""

    def __init__(self, store, counts, slot: int, latencies: dict | None = None):
        self._store, self._counts, self._slot, self._latencies = store, counts, slot, latencies
        self._latency = None if latencies is None else latencies.setdefault("clone" if slot & 1 else "main", {})

    def clone(self) -> "CountingStore":
        return CountingStore(self._store.clone(), self._counts, self._slot | 1, self._latencies)

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name not in OPS:
            return attr
        index = self._slot * len(OPS) + OPS.index(name)
        counts = self._counts

        latency = self._latency

        def counted(*args, **kwargs):
            counts[index] += 1
            if latency is None:
                return attr(*args, **kwargs)
            t = time.monotonic()
            try:
                return attr(*args, **kwargs)
            finally:
                latency[name] = max(latency.get(name, 0.0), time.monotonic() - t)

        return counted


def _worker_class():
    from hybridrl.distributed.dispatch import OneToAll
    from hybridrl.workers.base import Worker, register

    class BenchWorker(Worker):
        __qualname__ = "BenchWorker"   # its methods are named after it in messages: 'BenchWorker.busy'

        @register(dispatch=OneToAll("rank0"))
        def noop(self):
            return None

        @register()
        def echo(self, value: int = 0):
            return {"rank": self.ctx.rank, "value": value, "cpu_s": time.process_time()}

        @register(dispatch=OneToAll("rank0"))
        def busy(self, seconds: float = 60.0, raise_on: int = -1, marker: str = ""):
            if self.ctx.rank == raise_on:
                time.sleep(0.5)
                raise ValueError(f"benchmark failure on rank {self.ctx.rank} ({marker})")
            if self.ctx.rank != 0:   # the controller's share is done at once: it waits for the others
                time.sleep(seconds)

    return BenchWorker


def rank_main(rank: int, args, port: int, counts, tmp: Path) -> int:
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    from hybridrl.controller.worker_group import WorkerGroup, WorkerGroupError, format_report
    from hybridrl.distributed.bootstrap import DistContext
    from hybridrl.distributed.config import DistributedConfig
    from hybridrl.distributed.control import ControlPlane
    from hybridrl.distributed.placement import Roles
    from hybridrl.distributed.watchdog import Watchdog
    from hybridrl.workers.serve import serve

    world, per_node = args.one, args.ranks_per_node
    node = rank // per_node
    host = f"node{node}"
    socket.gethostname = lambda: host          # this process's simulated node
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
                       "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    cfg = DistributedConfig(device="cpu", heartbeat_interval_s=args.heartbeat_interval,
                            heartbeat_timeout_s=args.heartbeat_timeout, error_grace_s=1.0, call_timeout_s=300.0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=600))
    inner = dist.PrefixStore("hybridrl/", store)
    if hasattr(ControlPlane, "connect"):               # the control plane's own connection, as bootstrap makes it
        inner = inner.clone()
        inner.set_timeout(timedelta(days=365))
    latencies: dict = {}                              # rank 0: its connections' longest requests
    control = ControlPlane(CountingStore(inner, counts, 2 * rank, latencies if rank == 0 else None), rank, world)
    control.register_process(host, os.getpid())
    if store.add("bench/up", 1) == world:             # every rank up: the rendezvous torchrun's ranks pass
        store.set("bench/go", b"1")
    store.wait(["bench/go"])
    ctx = DistContext(rank, world, rank % per_node, per_node, torch.device("cpu"), "gloo", None, None, control,
                      cfg, roles=Roles(world, world), store=store)
    watchdog = Watchdog(control, cfg, format_failure=format_report)
    beats: list[float] = []
    if rank == 0:                                     # when the controller's heartbeats went out
        beat = watchdog.control.beat
        watchdog.control.beat = lambda *a: (beats.append(time.monotonic()), beat(*a))
    watchdog.start()
    worker = _worker_class()(ctx)
    if rank != 0:
        return serve(worker, ctx, watchdog)
    group = WorkerGroup(worker, ctx, watchdog)
    result: dict = {}
    try:
        _controller(group, worker, args, counts, tmp, result)
    except WorkerGroupError as err:
        result["error"] = str(err)
        result["failed_at"] = time.monotonic()
    except BaseException:  # noqa: BLE001 - the benchmark's own failure: recorded, then every rank stops
        result["bench_error"] = traceback.format_exc()
        group.abort("benchmark failed")
    gaps = sorted(b - a for a, b in zip(beats, beats[1:]))
    result["controller_beat_gap_s"] = {"max": gaps[-1], "p99": _quantile(gaps, 0.99)} if gaps else None
    result["controller_store_latency_max_s"] = latencies
    (tmp / "controller.json").write_text(json.dumps(result))
    watchdog.stop()
    return 1


def _controller(group, worker, args, counts, tmp: Path, result: dict) -> None:
    kind = type(worker)
    result["started_at"] = time.monotonic()
    for _ in range(args.warmup):
        group.call(kind.noop)
        group.call(kind.echo, value=1)
    (tmp / "warm").write_text("")
    if args.scenario == "calls":
        times: dict[str, list[float]] = {"noop": [], "echo": []}
        before, started = list(counts), time.monotonic()
        cpu0 = [o["cpu_s"] for o in group.call(kind.echo)]
        for i in range(args.calls):
            result["calls_started"] = i + 1
            t = time.perf_counter()
            group.call(kind.noop)
            times["noop"].append(time.perf_counter() - t)
            t = time.perf_counter()
            out = group.call(kind.echo, value=i)
            times["echo"].append(time.perf_counter() - t)
            assert [o["rank"] for o in out] == list(range(group.world_size)) and out[-1]["value"] == i
        during, calls_s = list(counts), time.monotonic() - started
        cpu = [(o["cpu_s"] - c0) / (2 * args.calls) for o, c0 in zip(out, cpu0)]   # both threads, per call
        time.sleep(args.idle)
        idle = list(counts)
        slot = slice(0, len(OPS))                      # the controller's main connection
        result.update(times=times, calls_s=calls_s, idle_s=args.idle, controller_cpu_s=cpu[0],
                      controller_requests=_by_op(before[slot], during[slot]),
                      worker_cpu_s=statistics.median(cpu[1:]),
                      requests_calls=_by_op(before, during), requests_idle=_by_op(during, idle))
        result["abort_at"] = time.monotonic()
        group.abort("benchmark: abort with every worker idle")
        return
    raise_on = group.world_size - 1 if args.scenario == "raise" else -1
    (tmp / "busy").write_text(str(time.monotonic()))
    result["call_at"] = time.monotonic()
    group.call(kind.busy, seconds=120.0, raise_on=raise_on, marker="m4rk")
    result["bench_error"] = "the busy call returned"


def _by_op(before: list[int], after: list[int]) -> dict[str, int]:
    out = dict.fromkeys(OPS, 0)
    for i, (a, b) in enumerate(zip(before, after)):
        out[OPS[i % len(OPS)]] += b - a
    return {k: v for k, v in out.items() if v}


def _uss_mib(pids: list[int]) -> list[float]:
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid).memory_full_info().uss / 2**20)
        except psutil.Error:
            pass
    return out


def one_launch(args) -> dict:
    """N ranks and a store host, forked from this process; returns what the controller and the clock saw."""
    import multiprocessing

    import torch  # noqa: F401 - imported before forking, so every rank shares its pages
    import torch.distributed as dist
    from datetime import timedelta

    import hybridrl.controller.worker_group  # noqa: F401
    import hybridrl.workers.serve  # noqa: F401

    tmp = Path(tempfile.mkdtemp(prefix="hybridrl-cp-"))
    counts = multiprocessing.RawArray("q", 2 * args.one * len(OPS))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store_pid = os.fork()
    if store_pid == 0:                                   # the store host (torchrun's agent in a real job)
        os.setsid()
        server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # noqa: F841 - kept alive
                               timeout=timedelta(seconds=600))
        while True:
            time.sleep(3600)
    pids: dict[int, int] = {}
    started = time.monotonic()
    for rank in range(args.one):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = rank_main(rank, args, port, counts, tmp)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    out: dict = {"world_size": args.one, "scenario": args.scenario}
    exits: dict[int, float] = {}
    codes: dict[int, int] = {}
    deadline = time.monotonic() + args.launch_timeout
    while not (tmp / "warm").exists() and time.monotonic() < deadline and not _reap(pids, exits, codes):
        time.sleep(0.05)
    out["warm_s"] = time.monotonic() - started
    time.sleep(0.5)
    uss = _uss_mib([p for p in pids if p not in exits])
    out["uss_mib_median"] = statistics.median(uss) if uss else None
    out["uss_mib_total"] = sum(uss)
    killed_at, victims = None, []
    if args.scenario == "kill":
        while not (tmp / "busy").exists() and time.monotonic() < deadline and not exits:
            time.sleep(0.02)
            _reap(pids, exits, codes)
        time.sleep(1.0)                                  # every rank inside the busy call
        last_node = (args.one - 1) // args.ranks_per_node
        if last_node == 0:
            raise SystemExit("the kill scenario needs two nodes or more: --ranks-per-node < world size")
        victims = [pid for pid, r in pids.items() if r // args.ranks_per_node == last_node]
        killed_at = time.monotonic()
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out["killed_ranks"] = sorted(pids[p] for p in victims)
        out["killed_node"] = f"node{last_node}"
    while len(exits) < len(pids):
        if not _reap(pids, exits, codes):
            time.sleep(0.005)
        if time.monotonic() > deadline + args.launch_timeout and not out.get("hung"):
            out["hung"] = sorted(r for p, r in pids.items() if p not in exits)
            for p in pids:
                if p not in exits:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(store_pid, signal.SIGKILL)
        os.waitpid(store_pid, 0)
    ctl = json.loads((tmp / "controller.json").read_text()) if (tmp / "controller.json").exists() else {}
    survivors = [t for p, t in exits.items() if p not in victims]
    out["exit_codes_nonzero"] = sum(1 for c in codes.values() if c != 0)
    out["last_exit"] = max(survivors) if survivors else None
    out["controller"] = ctl
    if killed_at is not None:
        out["dead_to_exit_s"] = max(survivors) - killed_at
        out["dead_to_error_s"] = ctl.get("failed_at", float("nan")) - killed_at
    if "abort_at" in ctl:
        out["abort_to_exit_s"] = max(survivors) - ctl["abort_at"]
    if args.scenario == "raise" and "call_at" in ctl:
        out["raise_to_exit_s"] = max(survivors) - ctl["call_at"] - 0.5
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return out


def _reap(pids: dict[int, int], exits: dict[int, float], codes: dict[int, int]) -> int:
    """Collect the ranks that exited (their exit time and code); returns how many did now."""
    found = 0
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid in pids:
            exits[pid] = time.monotonic()
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            found += 1


# ------------------------------------------------------------------------------------ the driver

def launch(checkout: Path, n: int, scenario: str, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--one", str(n), "--scenario", scenario, "--out", f.name,
               "--calls", str(args.calls), "--warmup", str(args.warmup), "--idle", str(args.idle),
               "--ranks-per-node", str(args.ranks_per_node), "--heartbeat-timeout", str(args.heartbeat_timeout),
               "--heartbeat-interval", str(args.heartbeat_interval)]
        env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True,
                              timeout=args.launch_timeout * 3)
        text = Path(f.name).read_text()
    if proc.returncode != 0 or not text:
        raise SystemExit(f"{checkout} N={n} {scenario}: launch failed\n{proc.stderr[-4000:]}")
    out = json.loads(text)
    out["load_avg_1m"] = load
    out["stderr_tail"] = proc.stderr[-2000:]
    ctl = out["controller"]
    if "bench_error" in ctl:
        raise SystemExit(f"{checkout} N={n} {scenario}: {ctl['bench_error']}\n{proc.stderr[-3000:]}")
    return out


def summarize(run: dict, scenario: str, args) -> dict:
    """The figures of one launch; {"failed": why} when it did not get as far as measuring them."""
    ctl = run["controller"]
    expected = {"calls": "times", "raise": "call_at", "kill": "failed_at"}[scenario]
    if run.get("hung") or expected not in ctl:
        why = ctl.get("error") or (f"ranks {run['hung']} did not exit" if run.get("hung") else
                                   "the controller ended before it measured (see the launch's stderr)")
        return {"failed": why.splitlines()[0]}
    if scenario == "calls":
        calls = 2 * len(ctl["times"]["noop"])
        req_calls, req_idle = sum(ctl["requests_calls"].values()), sum(ctl["requests_idle"].values())
        return {"noop_ms": 1e3 * statistics.median(ctl["times"]["noop"]),
                "noop_p90_ms": 1e3 * _quantile(ctl["times"]["noop"], 0.9),
                "echo_ms": 1e3 * statistics.median(ctl["times"]["echo"]),
                "echo_p90_ms": 1e3 * _quantile(ctl["times"]["echo"], 0.9),
                "requests_per_call": req_calls / calls,
                "controller_requests_per_call": sum(ctl["controller_requests"].values()) / calls,
                "controller_cpu_ms_per_call": 1e3 * ctl["controller_cpu_s"],
                "worker_cpu_ms_per_call": 1e3 * ctl["worker_cpu_s"],
                "requests_per_s_calls": req_calls / ctl["calls_s"],
                "requests_per_s_idle": req_idle / ctl["idle_s"],
                "requests_by_op_calls": ctl["requests_calls"], "requests_by_op_idle": ctl["requests_idle"],
                "abort_to_exit_s": run["abort_to_exit_s"], "uss_mib_per_process": run["uss_mib_median"]}
    if scenario == "raise":
        err = ctl.get("error", "")
        rank = run["world_size"] - 1
        return {"raise_to_exit_s": run["raise_to_exit_s"],
                "error_names_rank_method_traceback": (f"rank {rank} failed in '" in err and "busy'" in err and "m4rk" in err
                                                      and "Traceback" in err)}
    err = ctl.get("error", "")
    return {"dead_to_exit_s": run["dead_to_exit_s"], "dead_to_error_s": run["dead_to_error_s"],
            "error": err.splitlines()[0] if err else "",
            "error_names_node_and_ranks": run["killed_node"] in err and all(
                str(r) in err for r in run["killed_ranks"])}


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="where to write the results")
    ap.add_argument("--ranks", default="8,32,128", help="comma-separated world sizes")
    ap.add_argument("--scenarios", default="calls,raise,kill")
    ap.add_argument("--calls", type=int, default=40, help="timed calls of each kind per launch")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of idle heartbeats measured")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--ranks-per-node", type=int, default=4)
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    ap.add_argument("--heartbeat-interval", type=float, default=0.5)
    ap.add_argument("--launch-timeout", type=float, default=240.0)
    ap.add_argument("--base", help="another checkout whose hybridrl package runs the same launches, interleaved")
    ap.add_argument("--head", default=str(ROOT))
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        Path(args.out).write_text(json.dumps(one_launch(args)))
        return 0
    if not args.json:
        ap.error("--json is required")
    sides = {"head": Path(args.head).resolve()}
    if args.base:
        sides = {"base": Path(args.base).resolve(), **sides}
    ranks = [int(n) for n in args.ranks.split(",")]
    scenarios = args.scenarios.split(",")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    runs: dict = {side: {str(n): {s: [] for s in scenarios} for n in ranks} for side in sides}
    order = list(sides)
    for rep in range(args.repeats):
        for n in ranks:
            for scenario in scenarios:
                for side in (order if rep % 2 == 0 else order[::-1]):
                    run = launch(sides[side], n, scenario, args)
                    summary = summarize(run, scenario, args)
                    if "failed" in summary:
                        summary["stderr_tail"] = run["stderr_tail"]
                    summary["load_avg_1m"] = run["load_avg_1m"]
                    runs[side][str(n)][scenario].append(summary)
                    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()
                             if not k.startswith("requests_by_op") and k != "stderr_tail"}
                    print(f"[{rep}] {side} N={n} {scenario}: {shown}", flush=True)
                    order = order[::-1]
                    Path(args.json + ".partial").write_text(json.dumps(runs))
    result = {"args": {k: v for k, v in vars(args).items() if k not in ("one", "scenario", "out")},
              "sides": {s: str(p) for s, p in sides.items()}, "cpus": os.cpu_count(), "median": {}, "growth": {},
              "runs": runs}
    for side in sides:
        med = result["median"][side] = {}
        for n in ranks:
            row = med[str(n)] = {}
            for scenario in scenarios:
                done = [r for r in runs[side][str(n)][scenario] if "failed" not in r]
                if len(done) < len(runs[side][str(n)][scenario]):
                    row[f"{scenario}_failed"] = [r["failed"] for r in runs[side][str(n)][scenario] if "failed" in r]
                for key, value in (done[0].items() if done else ()):
                    values = [r[key] for r in done]
                    if isinstance(value, bool):
                        row[key] = all(values)
                    elif isinstance(value, (int, float)):
                        row[key] = statistics.median(values)
                    elif key == "error":
                        row[key] = value
        first = med[str(ranks[0])]
        result["growth"][side] = {str(n): {k: med[str(n)][k] / first[k] for k in first if k in med[str(n)]
                                           and isinstance(first[k], float) and first[k] > 0}
                                  for n in ranks}
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.json + ".partial").unlink()
    keys = ("noop_ms", "echo_ms", "requests_per_call", "requests_per_s_idle", "abort_to_exit_s", "raise_to_exit_s",
            "dead_to_exit_s", "uss_mib_per_process")
    for side in sides:
        for n in ranks:
            print(side, n, {k: round(result["median"][side][str(n)][k], 3) for k in keys
                            if k in result["median"][side][str(n)]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
