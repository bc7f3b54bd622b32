"""`hybridrl chat MODEL`: talk to a model directory: text in, text out, its chat template applied.

    hybridrl chat runs/demo/sft/hf [--system TEXT] [--temperature T] [--max-new-tokens N]

Each line you type is a user turn; the model's reply is printed and kept in the conversation
(`/reset` starts over, `/quit` or end of input ends). Reads stdin line by line, so it also takes a
pipe (`echo "What is 12 * 7?" | hybridrl chat DIR`). The native engine generates; a run directory
means its exported model (RUN/hf). No tools run here: a tool call is shown as the model wrote it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="HF model directory (or a run directory: its hf/)")
    p.add_argument("--system", default="", help="a system message to start the conversation with")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--jsonl", action="store_true", help='print each reply as a JSON line {"turn", "reply"} '
                                                        "(for scripts: replies may span lines)")


def main(args: argparse.Namespace) -> int:
    from hybridrl.preflight import PreflightError, check_model

    model = Path(args.model)
    if (model / "run.json").exists() and (model / "hf" / "config.json").exists():
        model = model / "hf"
    try:
        check_model(str(model), key="MODEL")
    except PreflightError as err:
        print(f"hybridrl chat: {err}", file=sys.stderr)
        return 2
    from dataclasses import replace

    from transformers import AutoTokenizer

    from hybridrl.agent.chat import ChatFormat
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig
    from hybridrl.rollout.protocol import SamplingParams

    chat = ChatFormat(AutoTokenizer.from_pretrained(str(model)))
    engine = NativeEngine.from_pretrained(model, replace(NativeEngineConfig(), seed=args.seed), device=args.device)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {model} (/reset starts over, /quit or Ctrl-D ends)", file=sys.stderr)
    turn = 0
    try:
        while True:
            if interactive:
                print("you> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "/quit":
                break
            text = line.rstrip("\n")
            if text.strip() == "/reset":
                messages, turn = list(start), 0
                continue
            if not text.strip():
                continue
            messages.append({"role": "user", "content": text})
            out = asyncio.run(engine.generate(chat.prompt_ids(messages), sampling, f"chat/{turn}"))
            reply = chat.decode(out.token_ids)
            messages.append({"role": "assistant", "content": reply})
            if args.jsonl:
                import json

                print(json.dumps({"turn": turn, "reply": reply}), flush=True)
            else:
                print(("model> " if interactive else "") + reply, flush=True)
            turn += 1
    finally:
        engine.close()
    return 0
