"""The sandbox's memory cgroup, its syscall filter's preconditions, pid 1 under signals through the
real agent loop, and isolation=none as root: real processes doing the bad thing."""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from hybridrl.agent.config import ToolsConfig
from hybridrl.agent.sandbox import cgroups, seccomp
from hybridrl.agent.sandbox.pool import SandboxPool, SandboxUnavailable, tool_interpreter
from hybridrl.agent.tools.python import PythonTool
from tests.launch import ROOT


def config(**kwargs) -> ToolsConfig:
    base = dict(pool_size=1, warm=0, timeout_s=60.0, cpu_s=5, memory_mb=128, max_processes=8, audit_log="")
    return ToolsConfig(**{**base, **kwargs})


HOG = """
import os, mmap
kids = []
for _ in range(3):                       # each within RLIMIT_AS, together past the cgroup's limit
    pid = os.fork()
    if pid == 0:
        m = mmap.mmap(-1, 100 << 20)
        for off in range(0, 100 << 20, 4096):
            m[off] = 1
        os.read(os.open("/dev/zero", os.O_RDONLY), 1)
        import time; time.sleep(60)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print("all children ended")
"""


def test_the_memory_cgroup_stops_the_whole_sandbox_and_the_tool_says_so():
    async def go():
        async with SandboxPool(config()) as pool:
            if pool.memory_limit == "rlimit":
                pytest.skip(f"no cgroup can be made here: {pool.cgroup_problem}")
            tool = PythonTool(pool)
            return await tool({"code": HOG}), pool.stats()

    result, stats = asyncio.run(go())
    assert not result.ok and not result.infra_error
    assert result.metadata["oom_kills"] >= 1 and result.metadata["limit"] == "memory"
    assert result.text.endswith("[stopped: memory limit]")
    assert stats["memory_limit_hits"] == 1


def test_sandbox_cgroups_are_removed_when_the_pool_closes():
    # this process's cgroups only (their names carry its pid): another process's pools may come and go meanwhile
    pattern = f"/sys/fs/cgroup/**/{cgroups.PREFIX}{os.getpid()}-*"
    before = set(glob.glob(pattern, recursive=True))

    async def go():
        async with SandboxPool(config(warm=1)) as pool:
            await pool.run("print(1)")
            return pool.memory_limit

    if asyncio.run(go()) == "rlimit":
        pytest.skip("no cgroup can be made here")
    assert set(glob.glob(pattern, recursive=True)) <= before


def test_without_a_cgroup_the_pool_says_so_refuses_memfd_and_require_isolation_refuses(monkeypatch, caplog):
    monkeypatch.setattr(cgroups, "probe", lambda *a: (None, "cgroup.subtree_control: Read-only file system"))

    async def go(cfg, code=None):
        async with SandboxPool(cfg) as pool:
            return pool.stats(), (await pool.run(code) if code else None)

    with pytest.raises(SandboxUnavailable, match="no cgroup.*Read-only file system"):
        asyncio.run(go(config(require_isolation=True)))
    with caplog.at_level(logging.WARNING, logger="hybridrl.agent.sandbox.pool"):
        stats, r = asyncio.run(go(config(), "import os\ntry:\n    os.memfd_create('x')\n    print('MEMFD')\n"
                                            "except OSError as err:\n    print('refused', err.errno)"))
    assert stats["memory_limit"] == "rlimit" and "memory and process limits are per process" in caplog.text
    assert r.stdout == "refused 1\n"          # anonymous files would escape RLIMIT_AS: refused by the filter


def test_a_machine_the_filter_is_not_written_for_is_refused(monkeypatch):
    monkeypatch.setattr(seccomp, "machine", lambda: "s390x")
    seccomp.compile_filter.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="not s390x"):
            asyncio.run(SandboxPool(config()).start())
    finally:
        seccomp.compile_filter.cache_clear()


def test_both_libseccomp_bindings_export_the_same_program():
    """pyseccomp (this venv) and libseccomp's own binding (Debian's python3-seccomp, for the system
    Python) compile the same filter: the choice of binding changes nothing."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    probe = "import seccomp" if python else ""
    if not python or subprocess.run([python, "-c", probe], capture_output=True).returncode != 0:
        pytest.skip("libseccomp's own Python binding (python3-seccomp) is not installed for the system python")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from hybridrl.agent.sandbox import seccomp; "
            "import seccomp as official; assert seccomp._binding() is official; "
            "print(seccomp.compile_filter(inet=False, memfd=True).hex())")
    theirs = subprocess.run([python, "-I", "-c", code, str(ROOT)], capture_output=True, text=True, check=True)
    assert bytes.fromhex(theirs.stdout.strip()) == seccomp.compile_filter(inet=False, memfd=True)


def test_isolation_none_as_root_never_runs_tools_as_uid_0():
    """Forced isolation=none as root with an interpreter the slot's uid cannot run (under /root):
    refused, where the old pool ran the tool as uid 0 with a warning."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    python = tool_interpreter(config())[0]
    pid = os.fork()
    if pid == 0:                                   # can a dedicated uid run it?
        try:
            os.setgroups([])
            os.setgid(61999)
            os.setuid(61999)
            os.execv(python, [python, "-c", "1"])
        finally:
            os._exit(1)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0:
        pytest.skip(f"{python} is runnable by other users here: nothing to refuse")
    with pytest.raises(SandboxUnavailable, match="tools never run as uid 0"):
        asyncio.run(SandboxPool(config(isolation="none", force_isolation_none=True)).start())


# ------------------------------------------------------------------ pid 1 through the agent loop

SIGNALS = ("import os, signal\nfor sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):\n"
           "    try:\n        os.kill(1, sig)\n    except OSError:\n        pass\n"
           "raise SystemExit('signalled pid 1')")

EPISODE = """
import asyncio, json, sys
from transformers import AutoTokenizer
from hybridrl.agent.config import AgentConfig, ToolsConfig
from hybridrl.agent.loop import AgentRunner
from hybridrl.agent.testing import ScriptedEngine
from hybridrl.agent.tools.base import ToolBox
from hybridrl.data.episode import TaskInstance
from hybridrl.envs.tasks import get_task

def episode(tokenizer, python, code):
    call = '<tool_call>' + json.dumps({"name": "python", "arguments": {"code": code}}) + '</tool_call>'
    turns = [call, "<answer>5</answer>"]
    inst = TaskInstance(task="calculator", task_id="q1", messages=({"role": "user", "content": "What is 2 + 3?"},),
                        reference="5", tools=("python",), metadata={"expression": "2 + 3"})

    async def go():
        cfg = ToolsConfig(python=python, pool_size=1, warm=0, audit_log="", kill_switch="")
        async with ToolBox.from_config(cfg, names=["python"]) as box:
            engine = ScriptedEngine(tokenizer, lambda ids, turn: turns[min(turn, 1)])
            runner = AgentRunner(engine, tokenizer, agent_cfg=AgentConfig(max_new_tokens_per_turn=256), tools=box,
                                 run_id="r")
            traj = (await runner.run([inst], task=get_task("calculator")))[0]
            return {"status": traj.status.value, "reward": traj.reward, "isolation": box.pool.mode,
                    "calls": [[c.ok, c.error] for c in traj.tool_calls]}

    return asyncio.run(go())

if __name__ == "__main__":
    print(json.dumps(episode(AutoTokenizer.from_pretrained(sys.argv[1]), sys.executable, sys.argv[2])))
"""


def _check_episode(out: dict) -> None:
    assert out["status"] == "completed", out                   # scored, never infra_invalid
    assert out["calls"] == [[False, "exit code 1"]], out       # the tool's own error, which the policy sees
    assert out["reward"] == 1.0


def test_signals_to_pid_1_end_as_a_scored_tool_error_through_the_agent_loop_as_root(tokenizer):
    namespace: dict = {"__name__": "episode"}
    exec(EPISODE, namespace)
    out = namespace["episode"](tokenizer, "", SIGNALS)
    assert out["isolation"] == "root" or os.geteuid() != 0
    _check_episode(out)


@pytest.mark.slow
def test_signals_to_pid_1_end_as_a_scored_tool_error_through_the_agent_loop_in_userns_mode(tokenizer):
    """In userns mode the tool is uid 0 of the sandbox's user namespace, like pid 1: its signals reach
    pid 1 (in root mode they are refused), and before pid 1 set every signal to its default, SIGINT
    raised KeyboardInterrupt there and the episode became INFRA_INVALID."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or not python or not setpriv:
        pytest.skip("needs root (to become an unprivileged user), setpriv and a system python3")
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True).stdout.strip()
    if version != str(tuple(sys.version_info[:2])):
        pytest.skip(f"system python {version} cannot load this venv's packages")
    tmp = tempfile.mkdtemp(prefix="hybridrl-tokenizer-")
    try:
        tokenizer.save_pretrained(tmp)
        for path in [tmp] + [os.path.join(tmp, f) for f in os.listdir(tmp)]:
            os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
        site = [p for p in sys.path if p.endswith("site-packages") and ".venv" in p]
        env = {"PATH": "/usr/bin:/bin", "HOME": "/", "PYTHONPATH": os.pathsep.join([str(ROOT), *site]),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c",
                               EPISODE, tmp, SIGNALS], env=env, cwd="/", capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if "Operation not permitted" in proc.stderr and "userns" not in proc.stdout:
        pytest.skip("unprivileged user namespaces are disabled here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["isolation"] == "userns"
    _check_episode(out)
