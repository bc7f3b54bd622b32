"""The fourth red-team round, each attack performed by a real sandboxed process: boot's program
reopened through an inherited descriptor and rewritten (an escape from userns mode where the
trainer's user owns the checkout), an egress target that bricked the audit log and with it every
later call, egress connections that exhausted the trainer's descriptors, the host's abstract Unix
sockets from isolation=none, and CPU past a sandbox's share. The attack programs live in
`hybridrl/agent/sandbox/attacks_escape.py` (shared with `hybridrl agent sandbox-check`)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from hybridrl.agent.actions import ToolCall
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.attacks import run_attack_set
from hybridrl.agent.sandbox.attacks_escape import EGRESS_AUDIT, EGRESS_FDS
from hybridrl.agent.tools.base import ToolBox
from hybridrl.telemetry.audit import MAX_LINE, records, verify
from tests.launch import ROOT

NEW = ["boot_fd", "egress_audit", "egress_fds", "unix_abstract", "cpu_share"]


def config(**kwargs) -> ToolsConfig:
    base = dict(pool_size=1, warm=1, timeout_s=30.0, cpu_s=2, memory_mb=128, max_processes=8, max_file_mb=1,
                audit_log="")
    base.update(kwargs)
    return ToolsConfig(**base)


def system_python() -> str:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if not python:
        pytest.skip("needs a system python3 (a dedicated uid must be able to run it)")
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True).stdout.strip()
    if version != str(tuple(sys.version_info[:2])):
        pytest.skip(f"system python {version} cannot load this venv's packages")
    return python


def statuses(verdicts) -> dict[str, str]:
    return {v.name: v.status for v in verdicts}


def test_isolation_none_holds_only_0_to_2_no_host_unix_socket_and_its_cpu_share():
    """isolation=none (as root, forced; a dedicated uid): the tool holds no inherited descriptor,
    cannot open an AF_UNIX socket (the host's abstract sockets are in its network namespace) and
    gets its CPU share; egress does not exist in this mode (skipped, said so)."""
    if os.geteuid() != 0:
        pytest.skip("isolation=none is run here as root with force_isolation_none")
    cfg = config(isolation="none", force_isolation_none=True, python=system_python(), cpu_cores=0.5)
    mode, verdicts, limits = run_attack_set(cfg, None, NEW, with_limits=True)
    assert mode == "none"
    got = statuses(verdicts)
    assert got["egress_audit"].startswith("SKIP") and got["egress_fds"].startswith("SKIP")
    assert got["boot_fd"] == "PASS" and got["unix_abstract"] == "PASS", verdicts
    assert got["cpu_share"] == ("PASS" if limits["cpu_limit"] != "rlimit" else "NOT CONTAINED (no cpu cgroup)")


def writable_cpu_controller() -> str | None:
    """Where this machine offers a cpu controller this process may write (None: nowhere)."""
    from hybridrl.agent.sandbox.cgroups import _mounts

    for point, fstype, options in _mounts():
        if fstype == "cgroup" and "cpu" in options and os.access(point, os.W_OK):
            return point
        if fstype == "cgroup2" and os.access(point, os.W_OK):
            try:
                if "cpu" in open(os.path.join(point, "cgroup.controllers")).read().split():
                    return point
            except OSError:
                pass
    return None


def test_a_tiny_cpu_share_is_enforced_by_the_cgroup():
    """tools.cpu_cores=0.02: three spinning processes together get about 0.02 of a core (a lower
    bound on wall time, which load can only lengthen), as the cgroup's quota says."""
    if writable_cpu_controller() is None:
        pytest.skip("no writable cpu cgroup controller on this machine")
    mode, verdicts, limits = run_attack_set(config(cpu_cores=0.02, warm=0), None, ["cpu_share"], with_limits=True)
    (v,) = verdicts
    rate = float(v.detail.split("RATE")[1].split()[0])
    assert v.contained and rate <= 0.02 * 1.3 + 0.02, v.detail
    assert limits["cpu_limit"] in ("cfs_quota", "cpu.max") and v.status == "PASS", (limits, v)


OWNED_CHECKOUT = """
import json, sys
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.attacks import run_attack_set
cfg = ToolsConfig(python=sys.executable, pool_size=1, warm=1, cpu_s=2, memory_mb=128, max_processes=8, audit_log="",
                  max_file_mb=1)
mode, verdicts = run_attack_set(cfg, None, ["boot_fd"])
print(json.dumps({"mode": mode, "verdicts": {v.name: [v.status, v.detail] for v in verdicts}}))
"""


def test_boot_cannot_be_rewritten_from_a_checkout_the_trainer_owns():
    """The reported escape, performed: the trainer (uid 65534, isolation=userns) runs from a copy of
    the package it owns, as after `pip install -e .`; the tool reopens boot's descriptor with O_TRUNC
    and writes a payload in front of boot's program. Before, the next sandbox's boot ran it on the
    host (BOOT_HIJACKED on its stdout). Now the tool holds only 0-2, and boot.py is unchanged."""
    python = system_python()
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not setpriv:
        pytest.skip("needs root (to become an unprivileged user) and setpriv")
    owned = tempfile.mkdtemp(prefix="hybridrl-owned-checkout-")      # /tmp: the user can reach it
    try:
        _attack_from_owned_checkout(python, setpriv, Path(owned))
    finally:
        shutil.rmtree(owned, ignore_errors=True)


def _attack_from_owned_checkout(python: str, setpriv: str, checkout: Path) -> None:
    shutil.copytree(ROOT / "hybridrl", checkout / "hybridrl", ignore=shutil.ignore_patterns("__pycache__"))
    for root, dirs, files in os.walk(checkout):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, 65534, 65534)
    boot = checkout / "hybridrl" / "agent" / "sandbox" / "boot.py"
    before = hashlib.sha256(boot.read_bytes()).hexdigest()
    site = [p for p in sys.path if p.endswith("site-packages") and ".venv" in p]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": os.pathsep.join([str(checkout), *site])}
    proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c",
                           OWNED_CHECKOUT], env=env, cwd="/", capture_output=True, text=True, timeout=300)
    if "Operation not permitted" in proc.stderr and '"userns"' not in proc.stdout:
        pytest.skip("unprivileged user namespaces are disabled here")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["mode"] == "userns"
    assert report["verdicts"]["boot_fd"][0] == "PASS", report
    assert hashlib.sha256(boot.read_bytes()).hexdigest() == before


def _egress_cfg(tmp_path, **kwargs) -> ToolsConfig:
    return config(network="allowlist", allowed_destinations=["127.0.0.1:9"], warm=0,
                  audit_log=str(tmp_path / "audit.jsonl"), **kwargs)


def _python(code: str) -> ToolCall:
    return ToolCall("python", {"code": code}, "", "json")


def test_an_oversized_connect_target_fails_no_other_episode(tmp_path):
    """Episode A's tool sends CONNECT with an 11,000-byte target of 0xFF: refused at the head limit,
    logged cut. Episode B's call after it is an ordinary call (before: every later audit append
    raised, and B's call was an infrastructure error), the log verifies, nothing failed to write."""
    cfg = _egress_cfg(tmp_path)

    async def go():
        async with ToolBox.from_config(cfg) as box:
            pool = box.sandbox_pool()
            await pool.start()
            if pool.mode == "none":
                pytest.skip("egress needs namespaces")
            a = await box.call(_python(EGRESS_AUDIT.format(proxy_port=3128)), context={"episode": "A", "call": "1"})
            b = await box.call(_python("print(6 * 7)"), context={"episode": "B", "call": "1"})
            return a, b, box.stats()

    a, b, stats = asyncio.run(go())
    assert not a.infra_error and "reply b'HTTP/1.1 431" in a.text, a
    assert b.ok and not b.infra_error and b.text == "42\n", b
    path = tmp_path / "audit.jsonl"
    assert verify(path)[0] and max(len(line) for line in open(path, "rb")) <= MAX_LINE
    egress = [r for r in records(path) if r["kind"] == "egress"]
    assert len(egress) == 1 and egress[0]["verdict"] == "refused: request head over 8192 bytes"
    assert stats["sandbox"]["audit_failures"] == 0
    assert [r["episode"] for r in records(path) if r["kind"] == "sandbox_call"] == ["A", "B"]


def test_a_failed_audit_write_is_counted_not_an_infra_error(tmp_path, caplog):
    """The audit log cannot be written (here: its path became a directory): the tool call is the
    tool's as always; the failure is logged as an error and counted in the pool's stats."""
    cfg = config(warm=0, audit_log=str(tmp_path / "audit.jsonl"))

    async def go():
        async with ToolBox.from_config(cfg) as box:
            await box.sandbox_pool().start()
            (tmp_path / "audit.jsonl").unlink()
            (tmp_path / "audit.jsonl").mkdir()
            r = await box.call(_python("print(6 * 7)"), context={"episode": "A", "call": "1"})
            return r, box.stats()

    r, stats = asyncio.run(go())
    assert r.ok and not r.infra_error and r.text == "42\n", r
    assert stats["infra_errors"] == 0 and stats["sandbox"]["audit_failures"] == 1
    assert "could not record sandbox_call" in caplog.text


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_egress_connections_are_capped_per_sandbox(tmp_path):
    """Three sandboxes each open 60 connections to the proxy and hold them (an unfinished request
    head). The pool keeps at most egress_max_connections of each open (the rest are closed at once
    and counted): its process's descriptors stay bounded, and a fourth call runs meanwhile."""
    cap = 8
    cfg = _egress_cfg(tmp_path, pool_size=4, egress_max_connections=cap, timeout_s=60.0)
    hold = EGRESS_FDS.replace('print("DONE")', 'time.sleep(2)\nprint("DONE")').format(
        proxy_port=3128, port=9, egress_max_connections=cap)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _fds())
            time.sleep(0.01)

    async def go():
        async with ToolBox.from_config(cfg) as box:
            pool = box.sandbox_pool()
            await pool.start()
            if pool.mode == "none":
                pytest.skip("egress needs namespaces")
            base = _fds()
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            calls = [box.call(_python(hold), context={"episode": f"E{i}", "call": "1"}) for i in range(3)]
            calls.append(box.call(_python("print(6 * 7)"), context={"episode": "other", "call": "1"}))
            results = await asyncio.gather(*calls)
            stop.set()
            sampler.join()
            return base, results, pool.stats()

    base, results, stats = asyncio.run(go())
    for r in results[:3]:
        assert r.ok and "HELD" in r.text, r
        assert int(r.text.split("HELD")[1].split()[0]) <= cap, r.text
    assert results[3].ok and results[3].text == "42\n"
    assert stats["egress"]["over_cap"] >= 3 * (60 - cap) - 3, stats
    # per sandbox: its pipes, egress channel and listener (about 8) + cap held connections; before: 60 each
    assert peak[0] - base <= 4 * 8 + 3 * cap + 16, (base, peak)
    over = [r for r in records(tmp_path / "audit.jsonl") if r.get("verdict") == "refused: over the connection cap"]
    assert len(over) == 3 and sum(r["connections"] for r in over) == stats["egress"]["over_cap"]


RAISES_NOFILE = """
import asyncio, resource, sys
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.pool import SandboxPool
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

async def main():
    pool = SandboxPool(ToolsConfig(pool_size=1, warm=0, audit_log="", isolation=sys.argv[1],
                                   force_isolation_none=True, python=sys.argv[2]))
    await pool.start()
    await pool.close()

asyncio.run(main())
print(resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard), hard)
"""


def test_a_pool_raises_its_process_open_files_limit():
    """A trainer started with a low soft RLIMIT_NOFILE (256 here) runs at its hard limit once its
    sandbox pool has started (every process that runs tools starts one)."""
    python = system_python()
    out = subprocess.run([sys.executable, "-c", RAISES_NOFILE, "none" if os.geteuid() == 0 else "auto", python],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "True", out.stdout


def test_isolation_none_as_an_unprivileged_user():
    """isolation=none as uid 65534 (boot and the tool share the uid): the tool holds only 0-2 and
    cannot open boot's /proc/PID/fd either (boot is not dumpable: its status pipe would let the tool
    forge how it ended), nor an AF_UNIX socket."""
    from tests.agent.test_sandbox_attacks import USERNS_ATTACKS

    python = system_python()
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not setpriv:
        pytest.skip("needs root (to become an unprivileged user) and setpriv")
    site = [p for p in sys.path if p.endswith("site-packages") and ".venv" in p]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": os.pathsep.join([str(ROOT), *site])}
    script = USERNS_ATTACKS.replace("cgroup_parent=sys.argv[2])", "cgroup_parent=sys.argv[2], isolation='none')")
    assert script != USERNS_ATTACKS
    proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c", script,
                           json.dumps(["boot_fd", "unix_abstract", "egress_audit"]), ""], env=env, cwd="/",
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["mode"] == "none"
    got = {name: v[0] for name, v in report["verdicts"].items()}
    assert got == {"boot_fd": "PASS", "unix_abstract": "PASS", "egress_audit": "SKIP (isolation=none has no egress)"}, \
        report["verdicts"]
