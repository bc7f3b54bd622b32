"""Writes openenv_guess.jsonl beside this file: the SFT chats of recipes/openenv_guess_sft_cpu.yaml, played
on the rules of recipes/envs/openenv_guess.py (a number from 1 to 100, "higher" / "lower", seven guesses)
and laid out exactly as an OpenEnv episode reaches the model (the task's prompt, the reset observation, then
one assistant move and one observation a turn). Run from anywhere:

    python recipes/data/make_openenv_guess.py [--rows 1500] [--seed 0]

40% of the games bisect the interval still open (they always win within seven guesses); the others guess a
quarter of the way into it (they win 63 of the 100 numbers), so a model trained on the file mostly plays the
weaker way and RL has the better one to find.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT = "Play the game. End each turn with your move in <answer>...</answer>."
START = "I am thinking of a whole number from 1 to 100."
MAX_GUESSES = 7


def game(secret: int, fraction: float) -> list[dict[str, str]]:
    chat = [{"role": "user", "content": PROMPT}, {"role": "user", "content": START}]
    lo, hi = 1, 100
    for _ in range(MAX_GUESSES):
        guess = lo + int((hi - lo) * fraction)
        chat.append({"role": "assistant", "content": f"<answer>{guess}</answer>"})
        if guess == secret:
            break
        chat.append({"role": "user", "content": "higher" if guess < secret else "lower"})
        lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
    if chat[-1]["role"] == "user":
        chat.pop()                     # the seventh wrong guess ends the episode: no observation follows
    return chat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(__file__).with_name("openenv_guess.jsonl")
    with out.open("w") as f:
        for _ in range(args.rows):
            secret = rng.randint(1, 100)
            fraction = 0.5 if rng.random() < 0.4 else 0.25
            f.write(json.dumps({"messages": game(secret, fraction), "answer": str(secret)}) + "\n")
    print(f"wrote {args.rows} games to {out}")


if __name__ == "__main__":
    main()
