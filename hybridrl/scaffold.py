"""`hybridrl init task NAME [--dir D] [--from data|verifiers|mcp|openenv]`: a runnable task of your own, and its SFT and GRPO recipes.

    D/NAME.py           the task: options (typed, checked at load), instances that may call the
                        calculator, demonstrations with the tool turn, a verifier
    D/NAME_sft.yaml     supervised warm start from a base model (run.dir runs/NAME/sft)
    D/NAME_grpo.yaml    GRPO with the tool from the SFT model (run.dir runs/NAME/grpo)

With `--from data`, the task is `task.name: data` (hybridrl/envs/tasks/data.py) and its files are data:

    D/NAME.jsonl        two rows (a chat with its solution, the ground truth, extra info): add yours
    D/NAME_score.py     compute_score(solution_str, ground_truth, extra_info), veRL's signature
    D/NAME_sft.yaml     SFT on the file's assistant turns (sft.data), D/NAME_grpo.yaml GRPO on its prompts

The template is a working task (feet and inches to inches, with the calculator) that a ~2M-
parameter model learns on a CPU in minutes; replace its questions, demonstrations and verifier
with your own. The recipes name it `module:Class`, importable from the working directory.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from hybridrl.scaffold_recipes import GRPO_BODY

# The base model of the walk-through: the CPU demo's (`hybridrl demo`), made locally.
BASE_MODEL = "--arch qwen2 --hidden 192 --layers 4 --heads 6 --kv-heads 2 --intermediate 512 --seed 0"

TASK = '''\
"""{title}: a task made by `hybridrl init task {name}` (a template: make it yours).

    user:      How many inches are 7 ft 5 in?
    assistant: <calc>7 * 12 + 5</calc>
    tool:      89
    assistant: <answer>89</answer>

What to change: `make_instances` (the questions and their reference answers), `demonstration`
(how a solution looks, for SFT), `score` (the verifier), and the options.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hybridrl.config.fields import check_range
from hybridrl.envs.tasks import EpisodeOutcome, Task, TaskInstance, register_task, split_of, unique_instances
from hybridrl.reward import ExactNumber, RewardResult


@dataclass(kw_only=True)
class {cls}Options:
    """task.options.*: typed and checked when the recipe loads (a wrong value stops the run there)."""

    min_feet: int = 1
    max_feet: int = 999
    system_prompt: str = ""       # empty: no system turn

    def __post_init__(self) -> None:
        check_range("min_feet", self.min_feet, 0, 10**6)
        check_range("max_feet", self.max_feet, self.min_feet + 1, 10**6)


@register_task
class {cls}Task(Task):
    name = "{name}"
    version = 1                   # bump when the questions or the verifier change (recorded with runs)
    Options = {cls}Options
    action_formats = ("calc",)    # tool calls are written <calc>expression</calc>

    def __init__(self, cfg):
        super().__init__(cfg)
        self.correct = ExactNumber()

    def make_instances(self, n: int, rng: random.Random, split: str) -> list[TaskInstance]:
        """`n` seeded instances of `split`; a fixed hash partition keeps train and validation apart."""
        def one(r: random.Random) -> TaskInstance | None:
            feet, inches = r.randint(self.options.min_feet, self.options.max_feet), r.randint(0, 11)
            key = f"{{feet}}ft{{inches}}in"
            if split_of(key) != split:
                return None
            system = self.options.system_prompt
            messages = [{{"role": "system", "content": system}}] if system else []
            messages.append({{"role": "user", "content": f"How many inches are {{feet}} ft {{inches}} in?"}})
            return TaskInstance(task=self.name, task_id=f"{name}-{{key}}", messages=tuple(messages),
                                reference=str(12 * feet + inches),
                                tools=("calculator",),               # the tools this instance may call
                                metadata={{"expression": f"{{feet}} * 12 + {{inches}}"}})

        return unique_instances(one, n, rng)

    def demonstration(self, instance: TaskInstance, rng: random.Random, *, use_tool: bool,
                      guess_correct: bool) -> list[dict[str, str]]:
        """A solved chat for SFT: with the tool turn, or a guess (right or a near miss)."""
        chat = [dict(m) for m in instance.messages]
        if use_tool:
            return chat + [{{"role": "assistant", "content": f"<calc>{{instance.metadata['expression']}}</calc>"}},
                           {{"role": "tool", "content": instance.reference}},
                           {{"role": "assistant", "content": f"<answer>{{instance.reference}}</answer>"}}]
        guess = int(instance.reference)
        if not guess_correct:
            guess += rng.choice([-1, 1]) * rng.randint(1, 9)
        return chat + [{{"role": "assistant", "content": f"<answer>{{guess}}</answer>"}}]

    def score(self, instance: TaskInstance, outcome: EpisodeOutcome) -> RewardResult:
        """The verifier: 1 for the right number. More terms, each with its evaluator's id, shape the
        reward: e.g. hybridrl.reward.AnswerFormat weighted by task.format_weight."""
        return RewardResult().add("correct", self.correct(outcome.answer, instance.reference), self.correct.id)
'''

HEADER = '''\
# {what} for the {name} task (made by `hybridrl init task {name}`), 2 CPU ranks.
#   hybridrl {command} {recipe_dir}{name}_{stage}.yaml
run:
  name: {name}-{stage}
  job: {job}
  dir: runs/{name}/{stage}
model:
  path: {model}
distributed:
  nproc_per_node: 2
  device: cpu
task:
  name: {module}:{cls}Task
'''

SFT = '''\
  # the share of demonstrations that use the tool; the others guess, so GRPO has something to discover
  sft_tool_use_fraction: 0.4
  options:
    max_feet: 999
train:
  micro_batch_size: 32
  lr: 1.0e-3
  min_lr: 1.0e-4
  lr_warmup_steps: 30
  lr_decay_steps: ${{sft.steps}}
  lr_schedule: cosine
  weight_decay: 0.0
sft:
  num_demonstrations: 4096
  steps: 500
  batch_size: 64
'''

GRPO = '''\
  validation_size: 128
  options:
    max_feet: 999
''' + GRPO_BODY

DATA_ROWS = [
    {"messages": [{"role": "user", "content": "How many minutes are 2 h 15 min?"},
                  {"role": "assistant", "content": "<calc>2 * 60 + 15</calc>"},
                  {"role": "tool", "content": "135"},
                  {"role": "assistant", "content": "<answer>135</answer>"}],
     "answer": "135", "info": {"hours": 2, "minutes": 15}},
    {"messages": [{"role": "user", "content": "How many minutes are 3 h 15 min?"},
                  {"role": "assistant", "content": "<calc>3 * 60 + 15</calc>"},
                  {"role": "tool", "content": "195"},
                  {"role": "assistant", "content": "<answer>195</answer>"}],
     "answer": "195", "info": {"hours": 3, "minutes": 15}},
]

SCORE = '''\
"""The score function of the {name} task (made by `hybridrl init task {name} --from data`): veRL's
signature, called with the text of the episode's final assistant turn, the row's `answer` and its `info`.

Return a float (the reward), or a dict with `score` (the reward) and other numbers, each recorded in
the run ledger as a reward component (`correct` is what validation accuracy averages).
"""

import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def compute_score(solution_str, ground_truth, extra_info=None):
    answers = ANSWER.findall(solution_str)
    correct = float(bool(answers) and answers[-1].strip() == str(ground_truth).strip())
    return {{"score": correct, "correct": correct, "format": float(len(answers) == 1)}}
'''

DATA_HEADER = '''\
# {what}: the {name} data task (made by `hybridrl init task {name} --from data`), 2 CPU ranks.
#   hybridrl {command} {recipe_dir}{name}_{stage}.yaml
# {data} holds two rows: add yours (a chat with its solution, `answer`, optional `info`), then
# drop validation_path (the same two rows) to hold a fixed 10% of the prompts out for validation.
run:
  name: {name}-{stage}
  job: {job}
  dir: runs/{name}/{stage}
model:
  path: {model}
distributed:
  nproc_per_node: 2
  device: cpu
task:
  name: data
  validation_size: 128
  options:
    path: {data}
    score: {score}:compute_score
    validation_path: {data}   # the same rows (two are too few to hold any out)
    tools: [calculator]
'''

DATA_SFT = '''\
sft:
  data: {data}              # the chats' assistant turns (the loss covers nothing else)
  steps: 300
  batch_size: 64
train:
  micro_batch_size: 32
  lr: 1.0e-3
  min_lr: 1.0e-4
  lr_warmup_steps: 30
  lr_decay_steps: ${{sft.steps}}
  lr_schedule: cosine
  weight_decay: 0.0
'''

DATA_STAGES = {   # stage: (what, command, job, model.path, body)
    "sft": ("Supervised warm start on the file's solutions", "sft", "sft",
            "runs/{name}/base        # an HF model directory (a tiny one: hybridrl assets tiny-model --out DIR)",
            DATA_SFT),
    "grpo": ("GRPO on the file's prompts, scored by the function", "train", "rl", "runs/{name}/sft/hf",
             GRPO_BODY.replace("prompts_per_step: 16",
                               "prompts_per_step: 2       # at most the train rows: 16 once you have many"))
}

STAGES = {   # stage: (what, command, job, model.path, body)
    "sft": ("Supervised warm start", "sft", "sft",
            "runs/{name}/base        # an HF model directory (a tiny one: hybridrl assets tiny-model --out DIR)",
            SFT),
    "grpo": ("GRPO with the calculator from the SFT model", "train", "rl", "runs/{name}/sft/hf", GRPO),
}

NAME = re.compile(r"[a-z][a-z0-9_]*")


def class_name(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_") if part)


def module_path(directory: Path, name: str) -> tuple[str, str | None]:
    """The module to name in `task.name`, and the PYTHONPATH it needs (None: the working directory)."""
    try:
        relative = directory.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return name, str(directory.resolve())
    parts = [p for p in relative.parts if p != "."]
    if all(p.isidentifier() for p in parts):
        return ".".join([*parts, name]), None
    return name, str(directory.resolve())


def write(name: str, directory: Path, *, force: bool = False) -> dict[str, Path]:
    """Write the task module and its two recipes; returns {what: path}."""
    if not NAME.fullmatch(name):
        raise ValueError(f"task name {name!r}: use lowercase letters, digits and _ (a Python module name)")
    module, pythonpath = module_path(directory, name)
    recipe_dir = "" if directory.resolve() == Path.cwd().resolve() else f"{directory}/"
    fields = {"name": name, "cls": class_name(name), "module": module, "recipe_dir": recipe_dir,
              "title": name.replace("_", " ").capitalize()}
    files = {"task": directory / f"{name}.py", "sft": directory / f"{name}_sft.yaml",
             "grpo": directory / f"{name}_grpo.yaml"}
    existing = [str(p) for p in files.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists (--force overwrites)")
    directory.mkdir(parents=True, exist_ok=True)
    files["task"].write_text(TASK.format(**fields))
    for stage, (what, command, job, model, body) in STAGES.items():
        files[stage].write_text((HEADER + body).format(**fields, stage=stage, what=what, command=command, job=job,
                                                         model=model.format(**fields)))
    if pythonpath:
        files["pythonpath"] = Path(pythonpath)
    return files


def write_data(name: str, directory: Path, *, force: bool = False) -> dict[str, Path]:
    """`--from data`: the data file, the score module and the two recipes; returns {what: path}."""
    import json

    if not NAME.fullmatch(name):
        raise ValueError(f"task name {name!r}: use lowercase letters, digits and _ (a file name)")
    recipe_dir = "" if directory.resolve() == Path.cwd().resolve() else f"{directory}/"
    files = {"data": directory / f"{name}.jsonl", "score": directory / f"{name}_score.py",
             "sft": directory / f"{name}_sft.yaml", "grpo": directory / f"{name}_grpo.yaml"}
    existing = [str(p) for p in files.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists (--force overwrites)")
    directory.mkdir(parents=True, exist_ok=True)
    files["data"].write_text("".join(json.dumps(row) + "\n" for row in DATA_ROWS))
    files["score"].write_text(SCORE.format(name=name))
    fields = {"name": name, "recipe_dir": recipe_dir, "data": f"{recipe_dir}{name}.jsonl",
              "score": f"{recipe_dir}{name}_score.py"}
    for stage, (what, command, job, model, body) in DATA_STAGES.items():
        files[stage].write_text((DATA_HEADER + body).format(**fields, stage=stage, what=what, command=command,
                                                              job=job, model=model.format(**fields)))
    return files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the task's name (a Python module name: lowercase, digits, _)")
    parser.add_argument("--dir", default=".", help="where to write NAME.py and its recipes (default: here)")
    parser.add_argument("--force", action="store_true", help="overwrite files that exist")
    parser.add_argument("--from", dest="source", choices=("data", "verifiers", "mcp", "openenv"), default=None,
                        help="data: a task from a data file and a score function (task.name: data): NAME.jsonl, "
                             "NAME_score.py and its recipes, instead of a Task subclass; verifiers: a verifiers "
                             "taskset NAME_env.py and its recipe; mcp: an MCP tool server NAME_server.py, rows that "
                             "call it and its recipe; openenv: an OpenEnv environment NAME_env.py and its recipe "
                             "(docs/environments.md)")


def main(args: argparse.Namespace) -> int:
    source = getattr(args, "source", None)
    if source in ("verifiers", "mcp", "openenv"):
        return main_env(args, source)
    try:
        files = (write_data if source == "data" else write)(args.name, Path(args.dir), force=args.force)
    except (ValueError, FileExistsError) as err:
        print(f"hybridrl init task: {err}", file=sys.stderr)
        return 2
    if source == "data":
        print(f"wrote {files['data']} (two rows: add yours), {files['score']} (the score function), "
              f"{files['sft']} and {files['grpo']}\n"
              f"next, from this directory:\n"
              f"  hybridrl agent tasks {files['grpo']} -n 2                   # the prompts as the model sees them\n"
              f"  hybridrl assets tiny-model {BASE_MODEL} --out runs/{args.name}/base   # or model.path=DIR\n"
              f"  hybridrl sft {files['sft']}\n"
              f"  hybridrl train {files['grpo']}")
        return 0
    env = f"PYTHONPATH={files['pythonpath']} " if "pythonpath" in files else ""
    print(f"wrote {files['task']} (task {args.name}), {files['sft']} and {files['grpo']}\n"
          f"next, from this directory:\n"
          f"  {env}hybridrl agent tasks {files['sft']} --split sft -n 2        # look at its demonstrations\n"
          f"  hybridrl assets tiny-model {BASE_MODEL} --out runs/{args.name}/base   # or model.path=DIR\n"
          f"  {env}hybridrl sft {files['sft']}\n"
          f"  {env}hybridrl train {files['grpo']}")
    return 0


def main_env(args: argparse.Namespace, source: str) -> int:
    from hybridrl.scaffold_envs import write_env

    try:
        files = write_env(args.name, Path(args.dir), source, force=args.force)
    except (ValueError, FileExistsError) as err:
        print(f"hybridrl init task: {err}", file=sys.stderr)
        return 2
    made = ", ".join(str(p) for what, p in files.items() if what != "grpo")
    print(f"wrote {made} and {files['grpo']}\n"
          f"next, from this directory (pip install -e .[{source}] first):\n"
          f"  hybridrl agent tasks {files['grpo']} -n 2                   # the prompts as the model sees them\n"
          f"  hybridrl demo                                      # or model.path= an SFT model of your own\n"
          f"  hybridrl train {files['grpo']}")
    return 0
