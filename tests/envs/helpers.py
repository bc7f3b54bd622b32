"""A counter environment whose every execution leaves a line in a side-effect log (so tests
can tell executing from replaying), importable by subprocesses of the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from hybridrl.data.episode import TaskInstance, Transition


LOCKERS: list[subprocess.Popen] = []     # write-lock holders started from inside a step


class Interrupted(BaseException):
    """Not an Exception (as KeyboardInterrupt or SystemExit): no environment error handler sees it."""


class CounterEnv:
    def __init__(self, log_path: str, step_delay_s: float = 0.0, fail_on: int | None = None, meta=None):
        self.log_path, self.step_delay_s, self.fail_on = log_path, step_delay_s, fail_on
        self.meta = meta or {}
        self.pure = bool(self.meta.get("pure"))
        self.total = 0

    def reset(self, instance: TaskInstance, seed: int) -> str:
        self.total = 0
        return f"count to {instance.reference}"

    def step(self, action):
        if self.fail_on is not None and action.get("n") == self.fail_on:
            raise RuntimeError("environment crashed")
        time.sleep(self.step_delay_s)
        with open(self.log_path, "a") as f:
            f.write(json.dumps(action) + "\n")
        self.total += action["n"]
        if action["n"] == self.meta.get("die_on") and not os.path.exists(self.log_path + ".died"):
            open(self.log_path + ".died", "w").close()     # once: the restarted service survives it
            os._exit(19)                                   # the service process dies mid-step, effect done
        if action["n"] == self.meta.get("lock_on"):        # another process takes the write lock now
            LOCKERS.append(hold_write_lock(self.meta["db"]))
        if action["n"] == self.meta.get("interrupt_on"):    # the step ran, then the process lost track of it
            raise Interrupted("interrupted mid-step")
        info = {"unserialisable": object()} if action["n"] == self.meta.get("bad_info_on") else {}
        if action["n"] == self.meta.get("deep_on"):          # a result nested past the recursion limit
            deep: list = []
            for _ in range(5000):
                deep = [deep]
            info = {"deep": deep}
        return Transition(f"total {self.total}", reward=float(self.total >= 10), done=self.total >= 10, info=info)

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"]

    def close(self):
        self.total = 0


def counter_instance(log_path: str, **meta) -> TaskInstance:
    return TaskInstance(task="counter", task_id="counter-1", messages=({"role": "user", "content": "count"},),
                        reference="10", metadata={"log": log_path, **meta})


def make_counter_env(task: str, instance: TaskInstance) -> CounterEnv:
    return CounterEnv(instance.metadata["log"], instance.metadata.get("delay", 0.0),
                      instance.metadata.get("fail_on"), meta=instance.metadata)


def executions(log_path) -> list[dict]:
    try:
        with open(log_path) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


LOCKER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.read()          # hold the write lock until the test closes our stdin (or kills us)
db.execute("ROLLBACK")
"""


def hold_write_lock(db_path) -> subprocess.Popen:
    """A real process holding the database's write lock until `release_lock(proc)`."""
    proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(db_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def release_lock(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=60)


def serve(db_path: str) -> None:
    """A service process on `db_path` answering JSON-line commands on stdin (tests drive two at once)."""
    from hybridrl.envs.service import EnvService

    svc = EnvService(db_path, make_env=make_counter_env, busy_timeout_s=60.0)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            reply = svc.step(cmd["episode_id"], cmd["token"], cmd["action"], seq_no=cmd["seq"],
                             idempotency_key=cmd["key"])
            out = {"observation": reply.transition.observation, "replayed": reply.replayed}
        except Exception as err:  # noqa: BLE001 - reported to the test
            out = {"error": type(err).__name__, "message": str(err)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__" and sys.argv[1] != "rollout":       # python -m tests.envs.helpers DB
    serve(sys.argv[1])


class CountingEnv:
    """A task's environment whose every executed step appends (task id, seed, seq) to $HYBRIDRL_TEST_EXEC_LOG;
    with $HYBRIDRL_TEST_KILL_AT=K the process SIGKILLs itself as its K-th step begins."""

    executed = 0

    def __init__(self, inner, task_id: str):
        self.inner, self.task_id, self.steps, self.seed = inner, task_id, 0, 0
        self.pure = getattr(inner, "pure", False)

    def reset(self, instance, seed):
        self.steps, self.seed = 0, seed                  # the seed tells the attempts of one task apart
        return self.inner.reset(instance, seed)

    def step(self, action):
        CountingEnv.executed += 1
        if CountingEnv.executed == int(os.environ.get("HYBRIDRL_TEST_KILL_AT", "0")):
            os.kill(os.getpid(), 9)
        self.steps += 1
        with open(os.environ["HYBRIDRL_TEST_EXEC_LOG"], "a") as f:
            f.write(json.dumps([self.task_id, self.seed, self.steps]) + "\n")
        return self.inner.step(action)

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "steps": self.steps}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])
        self.steps = state["steps"]

    def close(self):
        self.inner.close()


def counting_make_env(task: str, instance: TaskInstance):
    from hybridrl.envs.service import default_make_env

    return CountingEnv(default_make_env(task, instance), instance.task_id)


def guess_number_rollout(db_path, tokenizer, *, make_env=None, step: int = 7):
    """Guess-number episodes (4 tasks x 2) through the leased service with a deterministic player
    (binary search on the feedback): what one RL step's rollout does. Returns the trajectories."""
    import asyncio
    import re

    from hybridrl.agent.config import AgentConfig
    from hybridrl.agent.loop import AgentRunner
    from hybridrl.agent.testing import ScriptedEngine
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.envs.client import LeasedEnvProvider
    from hybridrl.envs.service import EnvService
    from hybridrl.envs.tasks import get_task

    def bisect(ids, turn):
        text = tokenizer.decode(ids)
        lo, hi = 1, 100
        for guess, hint in re.findall(r"<answer>(\d+)</answer><\|im_end\|>\n<\|im_start\|>user\n(\w+)", text):
            lo, hi = (int(guess) + 1, hi) if hint == "higher" else (lo, int(guess) - 1)
        return f"<answer>{(lo + hi) // 2}</answer>"

    task = get_task("guess_number")
    svc = EnvService(db_path, make_env=make_env or counting_make_env)
    runner = AgentRunner(ScriptedEngine(tokenizer, bisect), tokenizer, agent_cfg=AgentConfig(max_turns=8),
                         tools=ToolBox([]), run_id="run", seed=3, envs=LeasedEnvProvider(svc))
    return asyncio.run(runner.run(task.train_split(4, seed=0), task=task, group_size=2, step=step))


if __name__ == "__main__" and sys.argv[1] == "rollout":       # python -m tests.envs.helpers rollout DB TOKENIZER
    from transformers import AutoTokenizer

    guess_number_rollout(sys.argv[2], AutoTokenizer.from_pretrained(sys.argv[3]))
