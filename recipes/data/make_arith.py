"""Writes arith.jsonl beside this file: the example data of the `data` task's recipes
(recipes/data_sft_cpu.yaml, recipes/data_grpo_cpu.yaml). Run from anywhere:

    python recipes/data/make_arith.py [--rows 3000] [--seed 0]

Each row is a chat and its ground truth, the layout `task.name: data` and `sft.data` read:

    {"messages": [{"role": "user", "content": "What is 4821 * 37 + 905?"},
                  {"role": "assistant", "content": "<calc>4821 * 37 + 905</calc>"},
                  {"role": "tool", "content": "179282"},
                  {"role": "assistant", "content": "<answer>179282</answer>"}],
     "answer": "179282", "info": {"expression": "4821 * 37 + 905"}}

The questions are hybridrl's calculator task's; 40% of the solutions call the calculator, the
others guess a near miss, so a model trained on the file mostly guesses and RL has the tool to find.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    from hybridrl.envs.config import TaskConfig
    from hybridrl.envs.tasks import get_task

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-use", type=float, default=0.4)
    parser.add_argument("--out", default=str(Path(__file__).with_name("arith.jsonl")))
    args = parser.parse_args()
    task = get_task("calculator", TaskConfig(name="calculator", seed=args.seed))
    rng = random.Random(f"arith/{args.seed}")
    instances = task.train_split(args.rows)
    lines = []
    for inst in instances:
        chat = task.demonstration(inst, rng, use_tool=rng.random() < args.tool_use, guess_correct=False)
        lines.append(json.dumps({"messages": chat, "answer": inst.reference,
                                 "info": {"expression": inst.metadata["expression"]}}, separators=(",", ":")))
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} rows to {args.out}")


if __name__ == "__main__":
    main()
