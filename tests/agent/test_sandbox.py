"""The tool sandbox: every limit is exercised by a real process doing the bad thing."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid

import psutil
import pytest

from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.pool import SandboxPool, SandboxUnavailable
from hybridrl.agent.tools.python import PythonTool
from tests.launch import ROOT


def config(**kwargs) -> ToolsConfig:
    base = dict(pool_size=2, warm=1, timeout_s=10.0, cpu_s=2, memory_mb=256, max_processes=6, max_file_mb=1,
                max_output_bytes=4096)
    base.update(kwargs)
    return ToolsConfig(**base)


async def started(cfg: ToolsConfig, *, need_namespaces: bool = True) -> SandboxPool:
    pool = await SandboxPool(cfg).start()
    if need_namespaces and pool.mode == "none":
        await pool.close()
        pytest.skip("the OS refused namespaces here (isolation=none); this test needs them")
    return pool


def run(coro):
    return asyncio.run(coro)


def run_once(code: str, cfg: ToolsConfig | None = None, *, need_namespaces: bool = True):
    """Run `code` in a fresh pool (closed afterwards) and return its result."""
    async def go():
        pool = await started(cfg or config(), need_namespaces=need_namespaces)
        try:
            return await pool.run(code)
        finally:
            await pool.close()

    return run(go())


def processes_of(uids) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["uids"]):
        if p.info["uids"] and p.info["uids"].real in uids:
            out.append(p)
    return out


def test_no_network_even_to_localhost():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    code = f"""
import socket
for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET, ("10.0.0.1", 80))):
    try:
        s = socket.socket(family)                # refused by the syscall filter (network=none)
        s.settimeout(2)
        s.connect(addr)
        print("CONNECTED", addr)
    except OSError as err:
        print("refused", addr, err.errno)
try:
    socket.getaddrinfo("pypi.org", 443)
    print("RESOLVED")
except OSError as err:
    print("no dns", err)
"""

    result = run_once(code)
    assert result.ok, result.stderr
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert result.stdout.count("refused") == 2
    with pytest.raises(BlockingIOError):
        listener.accept()                       # nothing ever reached the listener
    listener.close()


def test_fork_bomb_is_contained_and_leaves_nothing():
    cfg = config(max_processes=4, cpu_s=3)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    peak = []
    uids = []

    async def go():
        pool = await started(cfg)
        if pool.mode != "root":
            await pool.close()
            pytest.skip("counting the bomb's processes by uid needs isolation=root")
        uids.extend(pool.uids)
        try:
            task = asyncio.ensure_future(pool.run(bomb, timeout_s=1.5))
            while not task.done():
                peak.append(len([p for p in processes_of(uids) if _is_running(p)]))
                await asyncio.sleep(0.05)
            return await task
        finally:
            await pool.close()

    result = run(go())
    assert result.timed_out and result.limit_hit == "wall_clock"
    # one uid per sandbox: RLIMIT_NPROC binds it even though the pool runs as root
    # (a warm sandbox of another uid may also be alive: at most one more process)
    assert 2 <= max(peak) <= cfg.max_processes + 1, peak     # it did fork, and no further than the limit
    time.sleep(0.2)
    assert len(uids) == cfg.pool_size + cfg.warm and processes_of(uids) == []


def _is_running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_memory_hog_stops_at_the_address_space_limit():
    async def go():
        pool = await started(config(memory_mb=128), need_namespaces=False)
        try:
            big = await pool.run("x = bytearray(1 << 30)\nprint('allocated')")
            creep = await pool.run("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))")
            return big, creep
        finally:
            await pool.close()

    for result in run(go()):
        # the allocation fails inside the tool (MemoryError, which the tool sees); the pool does not
        # call it a limit, since a program could print the same text (limit_hit is decided outside)
        assert not result.ok and "MemoryError" in result.stderr, (result.stdout, result.stderr)
        assert result.limit_hit is None and result.cpu_s < 2
        assert "allocated" not in result.stdout


def test_infinite_loop_hits_the_cpu_limit_and_sleeping_hits_the_wall_clock():
    async def go():
        pool = await started(config(cpu_s=1), need_namespaces=False)
        try:
            # 1 CPU-second may take many wall seconds on a loaded machine: the wall-clock limit is far off
            spin = await pool.run("while True:\n    pass", timeout_s=300)
            sleep = await pool.run("import time\ntime.sleep(60)", timeout_s=0.5)
            return spin, sleep
        finally:
            await pool.close()

    spin, sleep = run(go())
    assert spin.limit_hit == "cpu" and not spin.timed_out
    assert sleep.timed_out and sleep.limit_hit == "wall_clock" and sleep.wall_s < 60


def test_a_100_mb_print_is_cut_at_the_output_limit():
    result = run_once("import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n"
                      "    sys.stdout.write(chunk)\nprint('finished')", config(max_output_bytes=10_000),
                      need_namespaces=False)
    assert result.output_truncated and result.limit_hit == "output"
    assert len(result.stdout) + len(result.stderr) <= 10_000
    assert "finished" not in result.stdout and result.wall_s < 10


def test_writes_outside_the_tool_directory_fail():
    marker = uuid.uuid4().hex
    # /tmp inside is the tool's own tmpfs (its working directory): a write there reaches no host path
    targets = [f"{ROOT}/escape-{marker}", f"/escape-{marker}", f"/usr/escape-{marker}", f"/etc/escape-{marker}",
               f"/dev/shm/escape-{marker}", f"/var/tmp/escape-{marker}"]
    code = f"""
import os
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("WROTE", path)
    except OSError as err:
        print("denied", path, err.strerror)
with open("inside.txt", "w") as f:
    f.write("fine")
print("inside", open("inside.txt").read(), os.getcwd() == os.environ["HOME"])
open("/tmp/escape-{marker}", "w").write("x")
try:
    with open("big.bin", "wb") as f:
        f.write(b"x" * (2 << 20))
    print("BIG WRITTEN")
except OSError as err:
    print("big refused", err.strerror)
"""

    result = run_once(code)
    assert result.ok, result.stderr
    assert "WROTE" not in result.stdout and result.stdout.count("denied") == len(targets)
    assert "inside fine True" in result.stdout
    assert "big refused File too large" in result.stdout
    for path in targets + [f"/tmp/escape-{marker}"]:
        assert not os.path.exists(path)


def test_the_tool_sees_nothing_of_the_parent_environment(monkeypatch):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", secret)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    code = f"""
import os
print(sorted(os.environ))
print(repr(dict(os.environ)))
for pid in ("1", "self", "{os.getpid()}"):
    try:
        print(pid, open(f"/proc/{{pid}}/environ", "rb").read())
    except OSError as err:
        print(pid, "unreadable", err.strerror)
"""

    result = run_once(code)
    assert result.ok, result.stderr
    assert secret not in result.stdout + result.stderr
    assert "['HOME', 'LANG', 'LC_ALL', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'PYTHONHASHSEED', 'PYTHONIOENCODING', " \
           "'TMPDIR']" in result.stdout
    assert "unreadable" in result.stdout            # the parent's pid does not exist in the sandbox


def test_private_directories_are_removed_and_never_shared():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "hybridrl-sbx-*")))

    async def go():
        pool = await started(config(), need_namespaces=False)
        try:
            first = await pool.run("import os\nopen('state.txt', 'w').write('secret')\nprint(os.listdir('.'))")
            second = await pool.run("import os\nprint(os.listdir('.'))")
            return first, second
        finally:
            await pool.close()

    first, second = run(go())
    assert first.stdout.strip() == "['state.txt']" and second.stdout.strip() == "[]"
    after = set(glob.glob(os.path.join(tempfile.gettempdir(), "hybridrl-sbx-*")))
    assert after <= before


def test_pool_bounds_concurrency_and_uses_warm_sandboxes():
    async def go():
        pool = await started(config(pool_size=2, warm=2), need_namespaces=False)
        try:
            while len(pool._warm) < 2:                  # let the warm sandboxes come up
                await asyncio.sleep(0.05)
            results = await asyncio.gather(*[pool.run("import time\nt0 = time.time()\ntime.sleep(0.4)\n"
                                                      "print(t0, time.time())") for _ in range(6)])
            return results, pool.stats()
        finally:
            await pool.close()

    results, stats = run(go())
    assert all(r.ok for r in results), [r.stderr for r in results]
    # the programs' own start/end times (the realtime clock is not namespaced): never more than
    # pool_size of them running at once, whatever the machine's load (no bound on the wall time)
    spans = [tuple(map(float, r.stdout.split())) for r in results]
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert 1 <= most <= 2, spans
    assert stats["runs"] == 6 and stats["warm_hits"] >= 2


def test_python_tool_reports_limits_as_text():
    async def go():
        pool = await started(config(cpu_s=1), need_namespaces=False)
        tool = PythonTool(pool)
        try:
            return [await tool({"code": c}) for c in ("print(6 * 7)", "raise ValueError('bad')",
                                                      "while True: pass")]
        finally:
            await pool.close()

    ok, raised, spin = run(go())
    assert ok.ok and ok.text == "42\n"
    assert not raised.ok and "ValueError: bad" in raised.text and raised.text.endswith("[exit code 1]")
    assert not spin.ok and spin.text.endswith("[stopped: CPU time limit]") and not spin.infra_error


def test_isolation_none_still_limits_reaps_and_filters():
    """The fallback's weaker guarantee, stated as a test: rlimits, clean environment and reaping
    of escaped processes hold, and the syscall filter keeps the host's network out of reach (no
    AF_INET socket); there is no filesystem isolation. As root only when forced."""
    python = shutil.which("python3", path="/usr/bin:/bin") or ""
    cfg = config(isolation="none", python=python, cpu_s=1, force_isolation_none=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    escape = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(120)\n"
              "print(os.getpid())")

    async def go():
        pool = await started(cfg, need_namespaces=False)
        try:
            net = await pool.run(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), 2)\n"
                                 f"    print('connected')\nexcept OSError as err:\n    print('refused', err.errno)")
            spin = await pool.run("while True:\n    pass", timeout_s=20)
            orphan = await pool.run(escape)
            return pool.mode, net, spin, orphan
        finally:
            await pool.close()

    mode, net, spin, orphan = run(go())
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()                       # nothing reached the host's listener
    listener.close()
    assert mode == "none" and net.isolation == "none"
    assert net.stdout == "refused 97\n"         # EAFNOSUPPORT: the filter refuses AF_INET
    assert spin.limit_hit == "cpu"
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and
                 "time.sleep(120)" in " ".join(p.info["cmdline"])]
    assert orphan.ok and leftovers == []


def test_required_isolation_fails_loudly_and_auto_falls_back_with_a_warning(monkeypatch, caplog):
    """An unprivileged user's pool: userns, else none with a warning (or an error when required)."""
    tried = []

    async def refuse(self, mode):
        tried.append(mode)
        return "unshare: Operation not permitted" if mode != "none" else None

    monkeypatch.setattr(SandboxPool, "_try", refuse)
    monkeypatch.setattr(SandboxPool, "_as_root", lambda self: False)

    async def go(cfg):
        pool = SandboxPool(cfg)
        try:
            await pool.start()
            return pool.mode
        finally:
            await pool.close()

    with pytest.raises(SandboxUnavailable, match="not available here"):
        run(go(config(require_isolation=True)))
    with pytest.raises(SandboxUnavailable):
        run(go(config(isolation="namespaces")))
    with caplog.at_level(logging.WARNING, logger="hybridrl.agent.sandbox.pool"):
        assert run(go(config())) == "none"
    assert "NO network or filesystem isolation" in caplog.text
    assert "root" not in tried


def test_as_root_the_pool_runs_in_root_mode_or_refuses(monkeypatch):
    """As root a failed root-mode probe is an error naming why, never a silent fall back to userns
    (whose uid 0 is the host's root) or none; isolation=none stays possible when asked for."""
    tried = []

    async def refuse_root(self, mode):
        tried.append(mode)
        return "mount tmpfs on /x: Permission denied" if mode == "root" else None

    monkeypatch.setattr(SandboxPool, "_try", refuse_root)
    monkeypatch.setattr(SandboxPool, "_as_root", lambda self: True)

    async def go(cfg):
        pool = SandboxPool(cfg)
        try:
            await pool.start()
            return pool.mode
        finally:
            await pool.close()

    with pytest.raises(SandboxUnavailable, match=r"running as root.*mount tmpfs on /x: Permission denied"):
        run(go(config()))
    assert tried == ["root"]
    # isolation=none as root: refused unless forced (and then never with uid 0 tools)
    with pytest.raises(SandboxUnavailable, match="force_isolation_none"):
        run(go(config(isolation="none")))
    assert run(go(config(isolation="none", force_isolation_none=True))) == "none"


def test_root_mode_works_with_a_private_temporary_directory(monkeypatch, tmp_path):
    """The pool's host directories under a 0700 TMPDIR (e.g. /root/tmp) do not stop root mode: the
    tool's uid never needs to reach them (its root is its own tmpfs)."""
    if os.geteuid() != 0:
        pytest.skip("root mode needs root")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    result = run_once("import os\nprint(os.getuid() != 0, os.getcwd())")
    assert result.isolation == "root" and result.ok, result.stderr
    assert result.stdout.split() == ["True", "/tmp"]


USERNS_PROBE = """
import asyncio, os, sys
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.pool import SandboxPool

async def main():
    async with SandboxPool(ToolsConfig(python=sys.executable, cpu_s=1, max_processes=8)) as pool:
        out = [pool.mode]
        # the spin's wall-clock limit is far above its 1 CPU-second: on a busy machine one CPU-second
        # can take many wall seconds, and the CPU limit must still be the one that stops it
        for code, timeout in (("import socket\\nsocket.create_connection(('127.0.0.1', 9), 1)", 30),
                              ("open('/usr/x', 'w')", 30), ("while True:\\n    pass", 300)):
            r = await pool.run(code, timeout_s=timeout)
            out.append(r.limit_hit or r.stderr.strip().splitlines()[-1])
        print(out)

asyncio.run(main())
"""


def test_userns_mode_for_unprivileged_users():
    """Run the pool as an unprivileged user: it must pick user namespaces and still isolate."""
    import subprocess
    import sys

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
    proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c",
                           USERNS_PROBE], env=env, cwd="/", capture_output=True, text=True, timeout=120)
    if "Operation not permitted" in proc.stderr + proc.stdout and "userns" not in proc.stdout:
        pytest.skip("unprivileged user namespaces are disabled here")
    assert proc.returncode == 0, proc.stderr
    mode, network, write, spin = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr
    assert mode == "userns", proc.stderr
    # no AF_INET socket at all (the syscall filter), and no route if there were one
    assert "Address family not supported" in network and "Read-only file system" in write and spin == "cpu"


def test_a_pool_survives_one_event_loop_per_step():
    pool = SandboxPool(config(warm=2))
    uids = set()

    async def step(i):
        await pool.start()
        uids.update(pool.uids)
        r = await pool.run(f"print({i} * 2)")
        await asyncio.sleep(0.2)                      # warm sandboxes of this loop come up
        return r.stdout.strip()

    assert [asyncio.run(step(i)) for i in range(3)] == ["0", "2", "4"]
    asyncio.run(pool.close())
    assert processes_of(uids) == []


def test_pools_in_one_host_never_share_a_uid():
    async def go():
        first, second = SandboxPool(config()), SandboxPool(config())
        await first.start()
        await second.start()
        try:
            return first.uids, second.uids
        finally:
            await first.close()
            await second.close()

    if os.geteuid() != 0:
        pytest.skip("uids are leased only when running as root")
    a, b = run(go())
    assert len(a) == len(b) == 3 and not set(a) & set(b)


KILLED_PARENT = """
import asyncio, json, sys, tempfile
from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox.pool import SandboxPool

_mkdtemp = tempfile.mkdtemp
def mkdtemp(*args, **kwargs):        # each directory this pool makes, named in sys.argv[1] as it is made
    path = _mkdtemp(*args, **kwargs)
    with open(sys.argv[1], "a") as made:
        made.write(path + "\\n")
    return path
tempfile.mkdtemp = mkdtemp

async def main():
    pool = await SandboxPool(ToolsConfig(pool_size=2, warm=2, timeout_s=600)).start()
    await asyncio.sleep(0.5)
    print(json.dumps({"mode": pool.mode, "uids": pool.uids}), flush=True)
    await pool.run("import time\\ntime.sleep(600)")

asyncio.run(main())
"""


def test_a_killed_parent_leaves_no_sandbox_behind(tmp_path):
    import json
    import signal
    import subprocess
    import sys

    from tests.launch import env_with_repo

    made = tmp_path / "made"        # the pool's own directories: other tests' sandboxes come and go beside it
    proc = subprocess.Popen([sys.executable, "-c", KILLED_PARENT, str(made)], cwd=ROOT, env=env_with_repo(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    if info["mode"] != "root":
        proc.kill()
        pytest.skip("uid accounting of the sandboxes needs isolation=root")
    time.sleep(0.5)                                     # the long tool is running
    assert processes_of(info["uids"]), "the sandboxes should be alive before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and processes_of(info["uids"]):
        time.sleep(0.1)
    assert processes_of(info["uids"]) == []
    time.sleep(0.3)
    stages = made.read_text().split()
    assert stages and all(os.path.basename(p).startswith("hybridrl-sbx-") for p in stages), stages
    assert [p for p in stages if os.path.exists(p)] == []
