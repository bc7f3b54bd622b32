"""A stateful task's episodes through the leased service, as RL training runs them: a rollout
process SIGKILLed mid-rollout, then the same episodes run again (what a resumed step does). Every
action the dead process committed is answered from the record; no environment step executes twice."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap

from tests.launch import ROOT, env_with_repo

ROLLOUT = textwrap.dedent("""
    import asyncio, json, re, sys
    from transformers import AutoTokenizer
    from hybridrl.agent.config import AgentConfig
    from hybridrl.agent.loop import AgentRunner
    from hybridrl.agent.testing import ScriptedEngine
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.envs.client import LeasedEnvProvider
    from hybridrl.envs.service import EnvService
    from hybridrl.envs.tasks import get_task
    from tests.envs.helpers import counting_make_env

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])

    def bisect(ids, turn):                     # a deterministic player: binary search on the feedback
        text = tokenizer.decode(ids)
        lo, hi = 1, 100
        for guess, hint in re.findall(r"<answer>(\\d+)</answer><\\|im_end\\|>\\n<\\|im_start\\|>user\\n(\\w+)", text):
            lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
        return f"<answer>{(lo + hi) // 2}</answer>"

    task = get_task("guess_number")
    svc = EnvService(sys.argv[1], make_env=counting_make_env)
    runner = AgentRunner(ScriptedEngine(tokenizer, bisect), tokenizer, agent_cfg=AgentConfig(max_turns=8),
                         tools=ToolBox([]), run_id="run", seed=3, envs=LeasedEnvProvider(svc))
    trajs = asyncio.run(runner.run(task.train_split(4, seed=0), task=task, group_size=2, step=7))
    print(json.dumps([[t.trajectory_id, t.status.value, t.reward, t.turns] for t in trajs]))
""")


def _rollout(db, tokenizer_dir, log, kill_at=0):
    env = env_with_repo({"HYBRIDRL_TEST_EXEC_LOG": str(log), "HYBRIDRL_TEST_KILL_AT": str(kill_at)})
    return subprocess.run([sys.executable, "-c", ROLLOUT, str(db), str(tokenizer_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_rollout_killed_mid_episode_is_answered_from_the_record_when_run_again(tmp_path, tiny_models):
    tok = tiny_models("qwen2")
    db, log = tmp_path / "envs.sqlite", tmp_path / "executions.log"
    killed = _rollout(db, tok, log, kill_at=9)             # SIGKILL as the 9th environment step begins
    assert killed.returncode == -9, killed.stderr[-2000:]
    before = [tuple(x) for x in map(json.loads, log.read_text().splitlines())]
    assert len(before) == 8

    again = _rollout(db, tok, log)                           # the resumed step: same episodes, same keys
    assert again.returncode == 0, again.stderr[-2000:]
    trajs = json.loads(again.stdout.splitlines()[-1])
    assert all(status == "completed" and reward == 1.0 for _, status, reward, _ in trajs)
    executed = [tuple(x) for x in map(json.loads, log.read_text().splitlines())]
    assert len(executed) == len(set(executed)) == sum(turns for *_, turns in trajs)   # each step once
    assert executed[:8] == before

    import sqlite3

    con = sqlite3.connect(db)
    kinds = [k for (k,) in con.execute("SELECT kind FROM events")]
    assert kinds.count("replay") == 8                        # what the dead process committed came back
    assert kinds.count("step") == len(executed)
    assert kinds.count("reclaimed_intent") == 1              # the 9th: claimed, never executed, pure: re-run
    keys = [k for (k,) in con.execute("SELECT idempotency_key FROM transitions")]
    assert all(re.fullmatch(r"run/guess-[0-9a-f]+/guess-[0-9a-f]+@7/[01]#\d+", k) for k in keys), keys[:3]
