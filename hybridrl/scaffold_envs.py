"""`hybridrl init task NAME --from verifiers|mcp|openenv`: a task from an environment of the ecosystem, and its GRPO
recipe.

    --from verifiers   D/NAME_env.py     a verifiers 0.4 taskset (`load_environment`): tasks + weighted rewards
                       D/NAME_grpo.yaml  task.name: verifiers on it (docs/environments.md)
    --from mcp         D/NAME_server.py  an MCP tool server (fastmcp) with one tool, run inside the tool sandbox
                       D/NAME.jsonl      two rows that call it (task.name: data), D/NAME_grpo.yaml
    --from openenv     D/NAME_env.py     an OpenEnv environment and its server app (a guessing game)
                       D/NAME_grpo.yaml  task.name: openenv on it (hybridrl starts the server)

Each is a working example in the calculator's format (a ~2M-parameter model warm-started by the demo's SFT
can learn it on a CPU); replace its questions, rewards or tool with your own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hybridrl.scaffold_recipes import GRPO_BODY

NAME = re.compile(r"[a-z][a-z0-9_]*")

VERIFIERS_ENV = '''\
"""The {name} verifiers environment (made by `hybridrl init task {name} --from verifiers`): a verifiers 0.4
taskset whose tasks are the instances and whose `@vf.reward` methods, weighted, are the reward."""

import random
import re

import verifiers.v1 as vf

__all__ = ["{cls}Taskset", "load_environment"]

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class {cls}Data(vf.TaskData):
    answer: str


class {cls}Task(vf.Task[{cls}Data, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: {cls}Data, trace: vf.Trace) -> float:
        found = ANSWER.findall(trace.last_reply)
        return float(bool(found) and found[-1].strip() == task.answer)


class {cls}Config(vf.TasksetConfig):
    num_tasks: int = 2000
    seed: int = 0


class {cls}Taskset(vf.Taskset[{cls}Task, {cls}Config]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            feet, inches = rng.randint(1, 999), rng.randint(0, 11)
            yield {cls}Task({cls}Data(id=f"{name}-{{i}}", prompt=f"How many inches are {{feet}} ft {{inches}} in?",
                                     answer=str(feet * 12 + inches)), self.config.task)


def load_environment(num_tasks: int = 2000, seed: int = 0) -> {cls}Taskset:
    return {cls}Taskset({cls}Config(num_tasks=num_tasks, seed=seed))
'''

MCP_SERVER = '''\
"""The {name} MCP tool server (made by `hybridrl init task {name} --from mcp`): fastmcp over stdio, started
by hybridrl inside its tool sandbox; its tool `to_inches` reaches the model as `{server}_to_inches`."""

from fastmcp import FastMCP

mcp = FastMCP("{name}")


@mcp.tool
def to_inches(feet: int, inches: int) -> int:
    """Feet and inches as inches."""
    return feet * 12 + inches


if __name__ == "__main__":
    mcp.run(show_banner=False)
'''

OPENENV_ENV = '''\
"""The {name} OpenEnv environment (made by `hybridrl init task {name} --from openenv`): guess a number from 1 to
100, answered "higher" / "lower"; hybridrl starts this app's server and plays it (task.name: openenv)."""

import random
import re

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class {cls}Action(Action):
    message: str


class {cls}Observation(Observation):
    message: str = ""


class {cls}Environment(Environment[{cls}Action, {cls}Observation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.secret, self.guesses = random.Random(seed).randint(1, 100), 0
        self._state = State(episode_id=episode_id)
        return {cls}Observation(message="I am thinking of a whole number from 1 to 100.")

    def step(self, action, timeout_s=None, **kwargs):
        self.guesses += 1
        numbers = re.findall(r"-?\\d+", action.message)
        guess = int(numbers[-1]) if numbers else None
        if guess == self.secret:
            return {cls}Observation(message="correct", reward=1.0, done=True)
        hint = "Say a whole number." if guess is None else ("higher" if guess < self.secret else "lower")
        return {cls}Observation(message=hint, reward=0.0, done=self.guesses >= 7)

    @property
    def state(self):
        return self._state


# sessions at once: as many as the episodes hybridrl plays at once (agent.max_concurrent_episodes)
app = create_app({cls}Environment, {cls}Action, {cls}Observation, env_name="{name}", max_concurrent_envs=64)
'''

OPENENV_TASK = '''\
task:
  name: openenv
  options:
    app: {recipe_dir}{name}_env.py:app
agent:
  max_turns: 7
  max_new_tokens_per_turn: 32
  max_response_tokens: 512
  temperature: 1.0
'''

HEADER = '''\
# GRPO on the {name} task (made by `hybridrl init task {name} --from {source}`), 2 CPU ranks, from an SFT model
# in the calculator's format (the demo's: `hybridrl demo` writes runs/demo/sft/hf). From this directory:
#   hybridrl train {recipe_dir}{name}_grpo.yaml
run:
  name: {name}-grpo
  job: rl
  dir: runs/{name}/grpo
model:
  path: runs/demo/sft/hf
distributed:
  nproc_per_node: 2
  device: cpu
'''

VERIFIERS_TASK = '''\
task:
  name: verifiers
  options:
    environment: {recipe_dir}{name}_env.py:load_environment
    kwargs: {{num_tasks: 2000, seed: 0}}
    validation_fraction: 0.05
    tools: [calculator]
'''


MCP_TASK = '''\
task:
  name: data
  options:
    path: {recipe_dir}{name}.jsonl
    validation_path: {recipe_dir}{name}.jsonl   # two rows are too few to hold any out: add yours
    tools: [{server}_to_inches]
'''


def mcp_rows(server: str) -> list[dict]:
    rows = []
    for feet, inches in ((7, 5), (12, 3)):
        call = {"name": f"{server}_to_inches", "arguments": {"feet": feet, "inches": inches}}
        answer = str(feet * 12 + inches)
        rows.append({"messages": [{"role": "user", "content": f"How many inches are {feet} ft {inches} in?"},
                                  {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                                  {"role": "tool", "content": answer},
                                  {"role": "assistant", "content": f"<answer>{answer}</answer>"}],
                     "answer": answer})
    return rows


def write_env(name: str, directory: Path, source: str, *, force: bool = False) -> dict[str, Path]:
    """`--from verifiers` / `--from mcp`: the environment's files and its GRPO recipe; returns {what: path}."""
    if not NAME.fullmatch(name):
        raise ValueError(f"task name {name!r}: use lowercase letters, digits and _ (a file name)")
    recipe_dir = "" if directory.resolve() == Path.cwd().resolve() else f"{directory}/"
    server = name.replace("_", "-")
    fields = {"name": name, "cls": "".join(p.capitalize() for p in name.split("_") if p), "server": server,
              "recipe_dir": recipe_dir, "source": source}
    files = {"server": directory / f"{name}_server.py", "data": directory / f"{name}.jsonl"} if source == "mcp" \
        else {"env": directory / f"{name}_env.py"}
    files["grpo"] = directory / f"{name}_grpo.yaml"
    existing = [str(p) for p in files.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists (--force overwrites)")
    directory.mkdir(parents=True, exist_ok=True)
    task = {"verifiers": VERIFIERS_TASK, "mcp": MCP_TASK, "openenv": OPENENV_TASK}[source]
    body = GRPO_BODY
    if source == "openenv":
        files["env"].write_text(OPENENV_ENV.format(**fields))
        agent = GRPO_BODY[GRPO_BODY.index("agent:"):GRPO_BODY.index("tools:")]
        body = GRPO_BODY.replace(agent, "")                      # the task's own agent budgets (OPENENV_TASK)
    elif source == "verifiers":
        files["env"].write_text(VERIFIERS_ENV.format(**fields))
    else:
        files["server"].write_text(MCP_SERVER.format(**fields))
        files["data"].write_text("".join(json.dumps(r) + "\n" for r in mcp_rows(server)))
        body = body.replace("  warm: 0\n", f"  warm: 0\n  mcp:\n    - {{name: {server}, command: [python, "
                                           f"{recipe_dir}{name}_server.py]}}\n")
        body = body.replace("prompts_per_step: 16", "prompts_per_step: 2       # at most the train rows")
    files["grpo"].write_text((HEADER + task).format(**fields) + body)
    return files
