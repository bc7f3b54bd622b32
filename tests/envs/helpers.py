"""A counter environment whose every execution leaves a line in a side-effect log (so tests
can tell executing from replaying), importable by subprocesses of the tests."""

from __future__ import annotations

import json
import time

from hybridrl.data.episode import TaskInstance, Transition


class CounterEnv:
    def __init__(self, log_path: str, step_delay_s: float = 0.0, fail_on: int | None = None):
        self.log_path, self.step_delay_s, self.fail_on = log_path, step_delay_s, fail_on
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
        return Transition(f"total {self.total}", reward=float(self.total >= 10), done=self.total >= 10)

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
                      instance.metadata.get("fail_on"))


def executions(log_path) -> list[dict]:
    try:
        with open(log_path) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []
