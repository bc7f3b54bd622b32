"""A small deterministic training corpus for the tiny tokenizer.

It covers what the tiny models will see: chat markup, arithmetic with tool calls and answers,
JSON tool calls, a little Python and plain English, so that BPE learns useful merges while
digits stay one token each (the tokenizer splits them).
"""

from __future__ import annotations

import json
import random

_WORDS = (
    "the a an of to and in is it that for on with as was be by this are or from at which have "
    "what how many much compute calculate answer result number sum product difference value use "
    "tool calculator please think step first then final question user assistant system python "
    "print return def import if else for while true false none error output input total each "
    "plus minus times divided equals apples boxes trains hours minutes miles price cost items "
    "people students pages books cars days weeks year per every more less than twice half"
).split()

_OPS = ("+", "-", "*")


def _expression(rng: random.Random) -> str:
    terms = [str(rng.randint(0, 9999)) for _ in range(rng.randint(2, 3))]
    expr = terms[0]
    for t in terms[1:]:
        expr = f"{expr} {rng.choice(_OPS)} {t}"
    if rng.random() < 0.3:
        expr = f"({expr}) {rng.choice(_OPS)} {rng.randint(2, 99)}"
    return expr


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    return " ".join(words).capitalize() + rng.choice([".", "?", "!"])


def _chat(rng: random.Random) -> str:
    expr = _expression(rng)
    value = str(rng.randint(-99999, 999999))
    turns = [
        "<|im_start|>system\nYou are a helpful assistant. Use the calculator tool.<|im_end|>\n",
        f"<|im_start|>user\nWhat is {expr}?<|im_end|>\n",
        f"<|im_start|>assistant\n<calc>{expr}</calc><|im_end|>\n",
        f"<|im_start|>tool\n{value}<|im_end|>\n",
        f"<|im_start|>assistant\n<answer>{value}</answer><|im_end|>\n",
    ]
    if rng.random() < 0.5:
        call = json.dumps({"name": rng.choice(["calculator", "python"]), "arguments": {"expression": expr}})
        turns.insert(3, f"<|im_start|>assistant\n<tool_call>{call}</tool_call><|im_end|>\n")
    return "".join(turns)


def _python(rng: random.Random) -> str:
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    name = rng.choice(["x", "y", "total", "value", "result", "n"])
    return f"{name} = {a} {rng.choice(_OPS)} {b}\nprint({name})\n"


def corpus(num_documents: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    makers = (_chat, _chat, _sentence, _python)
    return [rng.choice(makers)(rng) for _ in range(num_documents)]
