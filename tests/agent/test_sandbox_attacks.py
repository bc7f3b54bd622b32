"""The red-team attacks, each performed by a real process through `SandboxPool.run` (the attack
programs live in `hybridrl/agent/sandbox/attacks.py`, shared with `hybridrl agent sandbox-check`)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from hybridrl.agent.actions import ToolCall
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.attacks import ATTACKS, attack_context, run_attack_set
from hybridrl.agent.tools.base import ToolBox
from hybridrl.cli import main
from tests.launch import ROOT

# the attacks of the red-team reports; the limits (fork bomb, memory, cpu, output) have their own tests.
# The third report's (from nested_tmpfs on) fail on the code before it: memory held past memory_mb
# through a nested tmpfs, memfd, nested SysV shm and three children, an inode flood, pid 1 killed by
# a signal or by prlimit (userns mode), sockets and kernel interfaces reachable, the persistent
# keyring kept across calls (root mode), host facts in /proc. The fourth's (from boot_fd on,
# `attacks_escape.py`, with more in tests/agent/test_sandbox_escape.py) fail on the code before it:
# boot's program reachable (and, in userns mode, writable) through an inherited descriptor, an egress
# target that bricked the audit log, no cap on a sandbox's egress connections, no cpu cgroup.
REPORTED = ["remount_rw", "umount", "host_files", "setuid", "keyring", "sysv_shm", "shm_survives", "spec_visible",
            "limit_spoof", "environment", "kill_sandbox",
            "nested_tmpfs", "memfd", "nested_shm", "children_memory", "inode_flood", "signal_pid1", "prlimit_pid1",
            "socket_families", "kernel_surface", "persistent_keyring", "host_facts",
            "boot_fd", "egress_audit", "egress_fds", "unix_abstract", "cpu_share"]


def config(**kwargs) -> ToolsConfig:
    base = dict(pool_size=1, warm=1, timeout_s=30.0, cpu_s=2, memory_mb=128, max_processes=8, max_file_mb=1,
                audit_log="")
    base.update(kwargs)
    return ToolsConfig(**base)


def test_every_reported_attack_is_contained_as_root(tmp_path):
    """As root (isolation=root): each attack of the report, plus a setuid-root copy of `id` made
    visible in the tool's root, which must still run without euid 0 (nosuid, no_new_privs)."""
    if os.geteuid() != 0:
        pytest.skip("the root-mode attack set needs root")
    # not under /tmp (the tool's own tmpfs there) nor a hidden path
    setuid_dir = tempfile.mkdtemp(dir="/var/cache" if os.path.isdir("/var/cache") else "/var/lib",
                                  prefix="hybridrl-setuid-")
    try:
        os.chmod(setuid_dir, 0o755)
        binary = os.path.join(setuid_dir, "id")
        shutil.copy("/usr/bin/id", binary)
        os.chown(binary, 0, 0)
        os.chmod(binary, 0o4755)
        cfg = config(visible_paths=ToolsConfig().visible_paths + [setuid_dir])
        ctx = attack_context(cfg, secret_paths=[str(tmp_path)], extra_setuid=[binary])
        (tmp_path / "samples.jsonl").write_text('{"answer": 42}\n')
        mode, verdicts, limits = run_attack_set(cfg, ctx, REPORTED, with_limits=True)
    finally:
        shutil.rmtree(setuid_dir, ignore_errors=True)
    assert mode == "root"
    if limits["memory_limit"] == "rlimit":
        pytest.skip(f"no cgroup can be made on this host ({limits['cgroup_problem']}): the memory attacks need one")
    by_name = {v.name: v for v in verdicts}
    assert set(by_name) == set(REPORTED)
    assert "ran " + binary in by_name["setuid"].detail or "ran " + binary in str(by_name["setuid"].result), \
        by_name["setuid"]                                  # the setuid copy did run
    failed = {v.name: (v.detail, v.result) for v in verdicts if v.status != "PASS"}
    assert failed == {}


USERNS_ATTACKS = """
import json, sys
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.attacks import run_attack_set
cfg = ToolsConfig(python=sys.executable, pool_size=1, warm=1, cpu_s=2, memory_mb=128, max_processes=8, audit_log="",
                  max_file_mb=1, cgroup_parent=sys.argv[2])
mode, verdicts, limits = run_attack_set(cfg, None, json.loads(sys.argv[1]), with_limits=True)
print(json.dumps({"mode": mode, **limits, "verdicts": {v.name: [v.status, v.detail] for v in verdicts}}))
"""


def delegated_cgroup(uid: int) -> tuple[str, list[str]]:
    """A cgroup v1 subtree (memory, pids and cpu where there is one) owned by `uid`, as an
    administrator delegates one to a user: (its path inside the hierarchies, the directories to
    remove). ("", []) where this host has no writable v1 memory and pids hierarchies."""
    from hybridrl.agent.sandbox.cgroups import _mounts

    points = {c: p for p, fstype, options in _mounts() if fstype == "cgroup" for c in ("memory", "pids", "cpu")
              if c in options}
    if not {"memory", "pids"} <= set(points):
        return "", []
    name = f"/hybridrl-test-delegated-{os.getpid()}"
    made = []
    try:
        for point in points.values():
            os.mkdir(point + name)
            made.append(point + name)
            for entry in [point + name] + [os.path.join(point + name, f) for f in os.listdir(point + name)]:
                os.chown(entry, uid, uid)
    except OSError:
        for d in made:
            os.rmdir(d)
        return "", []
    return name, made


def test_every_reported_attack_is_contained_in_userns_mode():
    """As an unprivileged user (isolation=userns, uid 0 of its own user namespace): umount and
    remount must fail (no capabilities), and the rest of the report holds too."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not python or not setpriv:
        pytest.skip("needs root (to become an unprivileged user), setpriv and a system python3")
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True).stdout.strip()
    if version != str(tuple(sys.version_info[:2])):
        pytest.skip(f"system python {version} cannot load this venv's packages")
    site = [p for p in sys.path if p.endswith("site-packages") and ".venv" in p]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": os.pathsep.join([str(ROOT), *site])}
    parent, made = delegated_cgroup(65534)
    try:
        proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c",
                               USERNS_ATTACKS, json.dumps(REPORTED), parent], env=env, cwd="/", capture_output=True,
                              text=True, timeout=300)
    finally:
        for d in made:
            os.rmdir(d)
    if "Operation not permitted" in proc.stderr and '"userns"' not in proc.stdout:
        pytest.skip("unprivileged user namespaces are disabled here")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["mode"] == "userns"
    assert set(report["verdicts"]) == set(REPORTED)
    failed = {n: v for n, v in report["verdicts"].items() if v[0] != "PASS"}
    if report["memory_limit"] == "rlimit":       # no delegated cgroup: said so, not promised
        assert failed.pop("children_memory", ["NOT CONTAINED (no memory cgroup)"])[0] == \
            "NOT CONTAINED (no memory cgroup)"
    else:
        assert report["memory_limit"] == "cgroup1"
    if report["cpu_limit"] == "rlimit":          # no delegated cpu hierarchy: said so, not promised
        assert failed.pop("cpu_share", ["NOT CONTAINED (no cpu cgroup)"])[0] == "NOT CONTAINED (no cpu cgroup)"
    assert failed == {}


def test_tool_errors_caused_by_the_policy_are_tool_errors_not_infra():
    """Overflow in the calculator, a lone surrogate and bad syntax in Python code: the policy sees an
    error and is scored on it; none of them makes the episode INFRA_INVALID."""
    async def go():
        async with ToolBox.from_config(config(warm=0)) as box:
            await box.sandbox_pool().start()
            calls = [ToolCall("calculator", {"expression": "2^10^400"}, "", "json"),
                     ToolCall("calculator", {"expression": "10^10^10^10"}, "", "json"),
                     ToolCall("python", {"code": "print('\ud800')"}, "", "json"),
                     ToolCall("python", {"code": "def f(:\n"}, "", "json"),
                     ToolCall("python", {"code": "print(int('9' * 5000))"}, "", "json")]
            return [await box.call(c) for c in calls], box.stats()

    results, stats = asyncio.run(go())
    for r in results:
        assert not r.ok and not r.infra_error and r.text.strip(), r
    assert "more than" in results[0].text
    assert "SyntaxError" in results[2].text and "SyntaxError" in results[3].text
    assert stats["infra_errors"] == 0 and stats["errors"] == len(results)
    assert stats["sandbox"]["isolation"] in ("root", "userns", "none")


def test_sandbox_check_prints_pass_or_fail_per_attack(capsys):
    """The audit command: every attack contained here (exit 0); with a memory limit that lets an 8 GiB
    allocation through, the memory attack is reported as FAIL and the exit status says so."""
    small = ["tools.pool_size=1", "tools.warm=0"]
    code = main(["agent", "sandbox-check", "tools.cpu_s=1", *small, "--attack", "spec_visible", "--attack", "memory",
                 "--attack", "limit_spoof", "--attack", "boot_fd", "--attack", "egress_audit"])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("spec_visible", "memory", "limit_spoof", "boot_fd", "egress_audit"):
        assert f"PASS {name}" in out
    code = main(["agent", "sandbox-check", "--json", "tools.memory_mb=20000", *small, "--attack", "memory"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["failed"] == ["memory"] and report["attacks"]["memory"]["status"] == "FAIL"
    assert main(["agent", "sandbox-check", "--attack", "no-such-attack"]) == 2


def test_the_attack_names_are_unique():
    names = [a.name for a in ATTACKS]
    assert len(names) == len(set(names)) and set(REPORTED) <= set(names)


def test_the_sandbox_isolation_is_a_run_metric():
    from types import SimpleNamespace

    from hybridrl.controller.metrics import engine_metrics

    ranks = [{"engine": {}, "agent": {"tool_calls": 3}, "sandbox": {"isolation": "root"}},
             {"engine": {}, "agent": {"tool_calls": 1}, "sandbox": {"isolation": "userns"}},
             {"engine": {}, "agent": {}, "sandbox": {"isolation": "root"}}]
    run = SimpleNamespace(counters={})
    for _ in range(2):                                  # a gauge, reported every step (not a delta)
        m = engine_metrics(ranks, run)
        assert m["sandbox/isolation_root"] == 2.0 and m["sandbox/isolation_userns"] == 1.0
    assert "sandbox/isolation_none" not in m
