"""The GPU check kit's environment, offline: a wheelhouse made where a package index is reachable,
installed from on a GPU machine where none is. Standard library only (it may run before any venv).

    python3 benchmarks/gpu_env.py wheels --wheelhouse DIR [--python-version 3.12] [--platform TAG] [--with-torch]
        (make gpu-wheels) Download, into DIR, wheels of every package hybridrl needs (setup.py's
        install_requires and `test` extra, with their dependencies) at the versions installed in
        the running interpreter's environment (the one the CPU suite passes with), for the target
        Python and platform. torch is left out (the GPU machine keeps its own CUDA build) unless
        --with-torch (then --torch-spec, default torch==2.13.0, with its dependencies).
    python3 benchmarks/gpu_env.py check --wheelhouse DIR --venv VENV [-- GPU_CHECK_ARGS...]
        (make gpu-check) Find a Python with torch: VENV's if it has torch, else this interpreter's
        (a VENV is made with --system-site-packages over it), else a fresh VENV with torch from DIR.
        Install what hybridrl needs and is missing there from DIR only (pip --isolated --no-index:
        no index or pip configuration is consulted), say what was reused and what was installed,
        then run benchmarks/gpu_check.py with hybridrl from this checkout (PYTHONPATH).
    python3 benchmarks/gpu_env.py prepare --wheelhouse DIR --venv VENV --json OUT
        The same environment, without running the kit: what was reused and installed in OUT
        (benchmarks/gpu_first_contact.py's first stage; the python it names runs the other stages).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("test",)
# the user-environment packages of the test extra (reasoning-gym pulls sympy, networkx, ...): their tests
# skip without them, and the GPU wheelhouse carries what the GPU paths need, not every task source
WITHOUT = ("envs",)
DEFAULT_TORCH = "torch==2.13.0"


def requirements(setup_py: Path = ROOT / "setup.py", extras=EXTRAS, without=WITHOUT) -> list[str]:
    """setup.py's install_requires and the given extras less those of the `without` extras, read from its
    source (no setuptools run).
    Module-level lists (``ENVS = [*REASONING_GYM, *DATA]``) may be named and unpacked inside them."""
    tree = ast.parse(setup_py.read_text())
    names: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                names[node.targets[0].id] = _literal(node.value, names)
            except ValueError:
                pass                                           # not a literal (ROOT = Path(...)): not a requirement
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kwargs = {k.arg: k.value for k in call.keywords}
    reqs = list(_literal(kwargs["install_requires"], names))
    extra_map = _literal(kwargs["extras_require"], names) if "extras_require" in kwargs else {}
    for extra in extras:
        reqs += extra_map.get(extra, [])
    dropped = {r for extra in without for r in extra_map.get(extra, [])}
    return [r for r in reqs if r not in dropped]


def _literal(node: ast.AST, names: dict[str, object]):
    """ast.literal_eval, plus names bound earlier in the module and ``*name`` inside a list."""
    if isinstance(node, ast.Name):
        if node.id not in names:
            raise ValueError(f"setup.py line {node.lineno}: {node.id!r} is not a module-level literal")
        return names[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        out: list = []
        for item in node.elts:
            if isinstance(item, ast.Starred):
                out.extend(_literal(item.value, names))
            else:
                out.append(_literal(item, names))
        return out
    if isinstance(node, ast.Dict):
        return {_literal(k, names): _literal(v, names) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def _name(requirement: str) -> str:
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i].strip()
    return requirement.strip()


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# ---------------------------------------------------------------------------------------------- wheels

def closure(roots: list[str], *, python_version: str, exclude: set[str]) -> dict[str, str]:
    """{name: installed version} of `roots` and everything they require, transitively, as installed
    in this interpreter's environment; markers evaluated for the target Python; `exclude`d names (and
    what only they require) left out."""
    from importlib import metadata

    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "python_version": python_version, "python_full_version": f"{python_version}.0"}

    def applies(req: Requirement, extras: set[str]) -> bool:
        return req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras)

    found: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(Requirement(r), {""}) for r in roots]             # (requirement, extras its requirer was asked for)
    while todo:
        req, extras = todo.pop()
        name = _canonical(req.name)
        if name in exclude or not applies(req, extras):
            continue
        wanted = {""} | set(req.extras)
        if {(name, e) for e in wanted} <= seen:
            continue
        seen |= {(name, e) for e in wanted}
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_env: {req.name} (required) is not installed here: run `make install` "
                             "first") from None
        found[name] = dist.version
        todo += [(Requirement(sub), wanted) for sub in dist.requires or []]
    return found


def platforms(tag: str) -> list[str]:
    """A manylinux_2_X_ARCH tag and every older manylinux tag a machine of that glibc also runs
    (pip matches --platform literally), with the legacy aliases (manylinux2014 = 2_17, 2010 = 2_12,
    1 = 2_5); any other tag as it is."""
    parts = tag.split("_")
    if not (tag.startswith("manylinux_2_") and len(parts) >= 4 and parts[2].isdigit()):
        return [tag]
    glibc, arch = int(parts[2]), "_".join(parts[3:])
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for minor, name in legacy.items() if minor <= glibc]


def wheels(args: argparse.Namespace) -> int:
    out = Path(args.wheelhouse).resolve()
    out.mkdir(parents=True, exist_ok=True)
    reqs = [r for r in requirements() if _canonical(_name(r)) != "torch"]
    pins = closure(reqs, python_version=args.python_version, exclude={"torch"})
    target = ["--only-binary=:all:", "--python-version", args.python_version]
    for platform in platforms(args.platform) if args.platform else []:
        target += ["--platform", platform]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out), *target,
           *sorted(f"{n}=={v}" for n, v in pins.items())]
    print(f"gpu_env: downloading {len(pins)} wheels (hybridrl's requirements at the versions installed here, "
          f"Python {args.python_version}{', ' + args.platform if args.platform else ''}) into {out}", flush=True)
    if subprocess.run(cmd).returncode != 0:
        return 1
    if args.with_torch:
        print(f"gpu_env: downloading {args.torch_spec} and its dependencies", flush=True)
        if subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(out), *target,
                           args.torch_spec]).returncode != 0:
            return 1
    (out / "requirements.txt").write_text("\n".join(requirements()) + "\n")
    names = sorted(p.name for p in out.glob("*.whl"))
    size = sum(p.stat().st_size for p in out.glob("*.whl")) / 2**20
    print(f"gpu_env: {len(names)} wheels, {size:.0f} MiB in {out}; copy it beside the checkout on the GPU machine "
          f"and run `make gpu-check` there")
    return 0


# ----------------------------------------------------------------------------------------------- check

def _probe(python: str) -> dict | None:
    """torch's version and where it lives, for an interpreter (None: no torch there)."""
    code = ("import json, sys, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'location': torch.__file__, 'prefix': sys.prefix}))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None


def _installed(python: str) -> dict[str, str]:
    code = ("import json; from importlib import metadata; print(json.dumps({d.metadata['Name']: d.version "
            "for d in metadata.distributions() if d.metadata['Name']}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def _pip(python: str, wheelhouse: Path, *reqs: str) -> subprocess.CompletedProcess:
    """pip install from the wheelhouse only: --isolated ignores pip's configuration files and PIP_*
    variables (no index URL, no find-links of this machine), --no-index asks no index."""
    return subprocess.run([python, "-m", "pip", "--isolated", "install", "-q", "--disable-pip-version-check",
                           "--no-index", "--find-links", str(wheelhouse), *reqs], capture_output=True, text=True)


def prepare(venv: Path, wheelhouse: Path) -> dict:
    """The interpreter the kit runs with and what was done to get it (see the module doc)."""
    python = str(venv / "bin" / "python")
    found = _probe(python) if (venv / "bin" / "python").exists() else None
    if found is not None:
        how, before = f"reused the venv {venv} (torch {found['torch']})", _installed(python)
    else:
        system = _probe(sys.executable)
        if not (venv / "bin" / "python").exists():
            flags = ["--system-site-packages"] if system is not None else []
            subprocess.run([sys.executable, "-m", "venv", *flags, str(venv)], check=True)
        before = _installed(python)
        if system is not None and _probe(python) is not None:
            how = f"reused the system torch {system['torch']} ({system['location']}) in a new venv {venv}"
        else:
            torch_wheels = sorted(wheelhouse.glob("torch-*.whl"))
            if not torch_wheels:
                raise SystemExit(f"gpu_env: no torch here (not in {venv}, not in {sys.executable}) and none in the "
                                 f"wheelhouse {wheelhouse}: install torch, or run `make gpu-wheels "
                                 f"GPU_WHEELS_ARGS=--with-torch` on a connected machine")
            how = f"installed torch from {torch_wheels[-1].name} into a new venv {venv}"
            proc = _pip(python, wheelhouse, "torch")
            if proc.returncode != 0:
                raise SystemExit(f"gpu_env: installing torch from {wheelhouse} failed: {proc.stderr.strip()[-1500:]}")
        found = _probe(python)
    reqs = requirements()
    proc = _pip(python, wheelhouse, *reqs)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"gpu_env: installing hybridrl's requirements from the wheelhouse {wheelhouse} failed "
                         f"(no index is used): {last}; run `make gpu-wheels` where an index is reachable and copy "
                         f"{wheelhouse.name}/ here")
    after = _installed(python)
    installed = sorted(f"{n}=={v}" for n, v in after.items() if before.get(n) != v)
    return {"python": python, "venv": str(venv), "how": how, "torch": found["torch"], "torch_cuda": found["cuda"],
            "wheelhouse": str(wheelhouse), "requirements": reqs, "installed": installed}


def check(args: argparse.Namespace) -> int:
    env = prepare(Path(args.venv).resolve(), Path(args.wheelhouse).resolve())
    print(f"gpu-check environment: {env['how']}; installed from the wheelhouse: "
          f"{', '.join(env['installed']) or 'nothing (everything was there)'}", flush=True)
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="gpu-env-", delete=False) as f:
        json.dump(env, f)
    run_env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    try:
        return subprocess.run([env["python"], str(ROOT / "benchmarks" / "gpu_check.py"), "--environment", f.name,
                               *args.gpu_check_args], env=run_env, cwd=ROOT).returncode
    finally:
        os.unlink(f.name)


def prepare_only(args: argparse.Namespace) -> int:
    """`prepare`, its record written to --json (what benchmarks/gpu_first_contact.py runs first)."""
    env = prepare(Path(args.venv).resolve(), Path(args.wheelhouse).resolve())
    Path(args.json).write_text(json.dumps(env, indent=1))
    print(f"gpu environment: {env['how']}; installed from the wheelhouse: "
          f"{', '.join(env['installed']) or 'nothing (everything was there)'}", flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="download the wheelhouse (needs a package index)")
    w.add_argument("--wheelhouse", default=str(ROOT / ".wheelhouse"))
    w.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}",
                   help="the GPU machine's Python (default: this one's)")
    w.add_argument("--platform", default=None, help="the GPU machine's wheel platform, e.g. manylinux_2_28_x86_64 "
                                                    "(default: this machine's)")
    w.add_argument("--with-torch", action="store_true", help="also torch (for a GPU machine without one)")
    w.add_argument("--torch-spec", default=DEFAULT_TORCH)
    c = sub.add_parser("check", help="install from the wheelhouse only, then run the GPU check kit")
    c.add_argument("--wheelhouse", default=str(ROOT / ".wheelhouse"))
    c.add_argument("--venv", default=str(ROOT / ".venv"))
    c.add_argument("gpu_check_args", nargs=argparse.REMAINDER, help="after --: benchmarks/gpu_check.py's arguments")
    p = sub.add_parser("prepare", help="install from the wheelhouse only; write what was done as JSON")
    p.add_argument("--wheelhouse", default=str(ROOT / ".wheelhouse"))
    p.add_argument("--venv", default=str(ROOT / ".venv"))
    p.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    if args.command == "prepare":
        return prepare_only(args)
    if args.command == "check":
        args.gpu_check_args = [a for a in args.gpu_check_args if a != "--"]
        return check(args)
    return wheels(args)


if __name__ == "__main__":
    sys.exit(main())
