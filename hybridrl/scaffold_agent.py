"""`hybridrl init agent NAME [--task TASK] [--model DIR] [--dir D]`: an agent of your own, written with the
OpenAI client, and the GRPO recipe that trains it through the gateway.

    D/NAME.py           `async def run(client, instance) -> Outcome`: asks the model with the tools listed,
                        runs each tool call with `call_tool`, sends the results back, stops at an answer
    D/NAME_grpo.yaml    GRPO on TASK (default: the shipped calculator task) with `task.agent: NAME:run`,
                        from DIR (default: the CPU demo's SFT model, runs/demo/sft/hf)

The template is the calculator agent of hybridrl/gateway/examples/, commented where a user changes it;
with the defaults it runs as it is after `hybridrl demo` (`hybridrl eval D/NAME_grpo.yaml` first).
docs/agents-howto.md says what the request may set and how `gateway.render_tools` couples to SFT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridrl.scaffold import NAME, module_path
from hybridrl.scaffold_recipes import GRPO_BODY

AGENT = '''\
"""{title}: an agent written with the OpenAI client (made by `hybridrl init agent {name}`; make it yours).

hybridrl trains it unchanged: each episode calls `run(client, instance)` with an `openai.AsyncOpenAI` client
pointed at the run's gateway, which renders the messages with the policy's chat template and keeps the
exact tokens. What the request may set, and what the run decides instead: docs/agents-howto.md.
"""

from __future__ import annotations

import json
import re

import openai

from hybridrl.gateway import Outcome, call_tool, is_budget_error

# The tools the model may call, as OpenAI function schemas. `call_tool` runs hybridrl's own tools (the ones
# the instance names: `instance.tools`); a tool of yours is a plain function called here instead.
TOOLS = [{{"type": "function", "function": {{
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / // % ^ and parentheses.",
    "parameters": {{"type": "object", "properties": {{"expression": {{"type": "string"}}}},
                   "required": ["expression"]}}}}}}]
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


async def run(client: openai.AsyncOpenAI, instance) -> Outcome:
    """One episode: the instance's messages, then turns until an answer (or a turn with nothing to do)."""
    messages = [dict(m) for m in instance.messages]
    while True:
        try:
            # temperature / top_p here are not applied: the run samples at agent.temperature
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except openai.BadRequestError as err:
            if is_budget_error(err):          # agent.max_turns, tokens or time spent: the episode is TRUNCATED
                return Outcome()
            raise                             # anything else is a bug of the agent's: it is reported as one
        message = reply.choices[0].message
        answers = ANSWER.findall(message.content or "")
        if answers or not message.tool_calls:
            # the task's verifier scores `answer`; Outcome(reward=x) would be a reward of the agent's own
            return Outcome(answer=answers[0].strip() if answers else None, num_answers=len(answers))
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = {{}}                # the model's mistake: the tool answers with an error it can read
            result = await call_tool(call.function.name, arguments)
            messages.append({{"role": "tool", "tool_call_id": call.id, "content": result}})
'''

RECIPE = '''\
# GRPO with the agent in {agent_file} (made by `hybridrl init agent {name}`), 2 CPU ranks.
#   hybridrl eval {recipe_dir}{name}_grpo.yaml -n 32     # the agent's episodes on held-out questions first
#   hybridrl train {recipe_dir}{name}_grpo.yaml
run:
  name: {name}-grpo
  job: rl
  dir: runs/{name}/grpo
model:
  path: {model}
distributed:
  nproc_per_node: 2
  device: cpu
task:
  name: {task}
  agent: {module}:run           # each episode: run(client, instance) through the gateway
  validation_size: 128
gateway:
  # false: the request's `tools` are parsed from the model's turns but not rendered into the prompt. Keep it
  # as the model's SFT data had it: a model trained without a tool list in its prompt (the demo's) is
  # asked in the format it knows; a chat model trained with one wants true.
  render_tools: {render_tools}
  tool_parser: auto             # hermes | llama3 | actions | none | auto (from the chat template)
# agent.*: the budgets are enforced at the gateway (is_budget_error in the agent); agent.temperature is what
# episodes are sampled at, whatever the request says.
''' + GRPO_BODY

DEMO_SFT = "runs/demo/sft/hf"


def write(name: str, directory: Path, *, task: str = "calculator", model: str = DEMO_SFT,
          render_tools: bool = False, force: bool = False) -> dict[str, Path]:
    """Write the agent module and its recipe; returns {what: path}."""
    if not NAME.fullmatch(name):
        raise ValueError(f"agent name {name!r}: use lowercase letters, digits and _ (a Python module name)")
    module, pythonpath = module_path(directory, name)
    recipe_dir = "" if directory.resolve() == Path.cwd().resolve() else f"{directory}/"
    files = {"agent": directory / f"{name}.py", "grpo": directory / f"{name}_grpo.yaml"}
    existing = [str(p) for p in files.values() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{existing[0]} exists (--force overwrites)")
    directory.mkdir(parents=True, exist_ok=True)
    files["agent"].write_text(AGENT.format(name=name, title=name.replace("_", " ").capitalize()))
    files["grpo"].write_text(RECIPE.format(name=name, agent_file=files["agent"], recipe_dir=recipe_dir,
                                           model=model, task=task, module=module,
                                           render_tools=str(render_tools).lower()))
    if pythonpath:
        files["pythonpath"] = Path(pythonpath)
    return files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the agent's name (a Python module name: lowercase, digits, _)")
    parser.add_argument("--task", default="calculator",
                        help="the recipe's task.name: a shipped task or module:Class (default: calculator)")
    parser.add_argument("--model", default=DEMO_SFT,
                        help=f"the recipe's model.path, an HF directory (default: the demo's SFT model, {DEMO_SFT})")
    parser.add_argument("--render-tools", action="store_true",
                        help="gateway.render_tools=true: the tools' schemas go into the prompt (for a model "
                             "whose SFT data had them there)")
    parser.add_argument("--dir", default=".", help="where to write NAME.py and NAME_grpo.yaml (default: here)")
    parser.add_argument("--force", action="store_true", help="overwrite files that exist")


def main(args: argparse.Namespace) -> int:
    try:
        files = write(args.name, Path(args.dir), task=args.task, model=args.model,
                      render_tools=args.render_tools, force=args.force)
    except (ValueError, FileExistsError) as err:
        print(f"hybridrl init agent: {err}", file=sys.stderr)
        return 2
    env = f"PYTHONPATH={files['pythonpath']} " if "pythonpath" in files else ""
    print(f"wrote {files['agent']} (the agent: async def run(client, instance)) and {files['grpo']}\n"
          f"next, from this directory ({args.model} must hold a model: `hybridrl demo` makes the default):\n"
          f"  {env}hybridrl eval {files['grpo']} -n 32      # the agent's episodes on held-out questions\n"
          f"  {env}hybridrl train {files['grpo']}\n"
          f"how to change it: docs/agents-howto.md")
    return 0
