"""`hybridrl init task NAME [--dir D]`: a runnable task of your own, and its SFT and GRPO recipes.

    D/NAME.py           the task: options (typed, checked at load), instances that may call the
                        calculator, demonstrations with the tool turn, a verifier
    D/NAME_sft.yaml     supervised warm start from a base model (run.dir runs/NAME/sft)
    D/NAME_grpo.yaml    GRPO with the tool from the SFT model (run.dir runs/NAME/grpo)

The template is a working task (feet and inches to inches, with the calculator) that a ~2M-
parameter model learns on a CPU in minutes; replace its questions, demonstrations and verifier
with your own. The recipes name it `module:Class`, importable from the working directory.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

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
train:
  micro_batch_size: 32
  lr: 5.0e-5
  lr_schedule: constant
  weight_decay: 0.0
  clip_grad: 1.0
rollout:
  native:
    kv_cache_mb: 64
agent:
  max_turns: 3
  max_new_tokens_per_turn: 32
  max_response_tokens: 96
  temperature: 1.0
tools:
  pool_size: 1
  warm: 0
algo:
  advantage: grpo
  norm_adv_by_std: false
  kl_coef: 0.0
trainer:
  total_steps: 20
  prompts_per_step: 16
  group_size: 8
  validate_every: 5
  checkpoint_every: 10
  keep_checkpoints: 1
'''

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the task's name (a Python module name: lowercase, digits, _)")
    parser.add_argument("--dir", default=".", help="where to write NAME.py and its recipes (default: here)")
    parser.add_argument("--force", action="store_true", help="overwrite files that exist")


def main(args: argparse.Namespace) -> int:
    try:
        files = write(args.name, Path(args.dir), force=args.force)
    except (ValueError, FileExistsError) as err:
        print(f"hybridrl init task: {err}", file=sys.stderr)
        return 2
    env = f"PYTHONPATH={files['pythonpath']} " if "pythonpath" in files else ""
    print(f"wrote {files['task']} (task {args.name}), {files['sft']} and {files['grpo']}\n"
          f"next, from this directory:\n"
          f"  {env}hybridrl agent tasks {files['sft']} --split sft -n 2        # look at its demonstrations\n"
          f"  hybridrl assets tiny-model {BASE_MODEL} --out runs/{args.name}/base   # or model.path=DIR\n"
          f"  {env}hybridrl sft {files['sft']}\n"
          f"  {env}hybridrl train {files['grpo']}")
    return 0
