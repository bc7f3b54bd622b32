"""A process holding a vLLM engine, killed outright (SIGKILL: nothing shuts down), leaves none of vLLM's
engine-core or worker processes behind (the engine's `distributed.reaper.Reaper`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hybridrl.distributed.reaper import descendants, start_time
from tests.launch import ROOT, env_with_repo

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

HOLDER = textwrap.dedent("""
    import json, sys, time
    from hybridrl.backends.vllm.config import VLLMConfig
    from hybridrl.backends.vllm.engine import VLLMEngine
    from hybridrl.distributed.reaper import descendants

    if __name__ == "__main__":
        engine = VLLMEngine(sys.argv[1], VLLMConfig(kv_cache_mb=16, max_model_len=512), seed=0)
        print("PIDS " + json.dumps({"vllm": engine._reaper.pids, "all": descendants()}), flush=True)
        time.sleep(600)
""")


def alive(pids: list[int]) -> list[int]:
    def running(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return [p for p in pids if running(p)]


def test_an_engine_holder_killed_by_sigkill_leaves_no_vllm_process(vllm_model, tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(script), str(vllm_model)], cwd=ROOT, env=env_with_repo(),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    seen = {"all": []}
    try:
        line = next(line for line in holder.stdout if line.startswith("PIDS "))   # vLLM logs to stdout too
        seen = json.loads(line[len("PIDS "):])
        assert seen["vllm"], "the engine started no process of its own: nothing was watched"
        assert set(seen["vllm"]) <= set(seen["all"])
        assert all(start_time(p) for p in seen["vllm"])
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 30
        while alive(seen["all"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert alive(seen["all"]) == [], "processes of the killed engine holder are still running"
    finally:
        holder.kill()
        for pid in alive(seen["all"]) + descendants(holder.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
