"""`hybridrl generate`: prompts in (JSONL), samples with logprobs out (JSONL).

    hybridrl generate --model HF_DIR --input prompts.jsonl --output out.jsonl \\
        [--greedy | --temperature T --top-p P --top-k K --seed S] --max-new-tokens N [--n K] \\
        [--config RECIPE] [rollout.key=value ...]

Input lines: {"id": ..., "token_ids": [...]}, or text: {"id", "text": "..."} (tokenized as it is)
or {"id", "messages": [{"role", "content"}, ...]} (the model's chat template applied, with the
assistant's turn opened). Output lines, in input order then sample order: {"id", "sample",
"token_ids", "logprobs", "finish_reason", "policy_version"}, and "text" (the sample decoded) for
text prompts. Sample k of
prompt `id` is request "<id>/<k>"; its seed is derived from --seed and that request id, so a
run is reproducible and independent of batching.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (config.json + *.safetensors)")
    parser.add_argument("--engine", default="native", choices=["native"], help="rollout engine")
    parser.add_argument("--input", required=True, help='JSONL, one {"id", "token_ids"}, {"id", "text"} or '
                                                       '{"id", "messages"} per line')
    parser.add_argument("--output", required=True, help="JSONL to write")
    parser.add_argument("--greedy", action="store_true", help="temperature 0 (argmax)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--seed", type=int, default=0, help="engine seed: each request's seed derives from it")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--config", default=None, help="recipe YAML whose `rollout` section configures the engine")
    parser.add_argument("overrides", nargs="*", help="rollout.key=value")


def read_prompts(path: Path, tokenizer_dir: str | None = None) -> list[tuple[str, list[int]]]:
    """(id, prompt token ids) per line; text and chat prompts are tokenized with the model's tokenizer."""
    prompts, seen, chat = [], set(), None
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno}: not JSON ({err.msg})") from None
        if not isinstance(row, dict) or "id" not in row or not ({"token_ids", "text", "messages"} & set(row)):
            raise ValueError(f'{path}:{lineno}: expected an object with "id" and one of "token_ids", "text", '
                             '"messages"')
        if "token_ids" not in row:
            if chat is None:
                chat = _chat_format(tokenizer_dir)
            if "messages" in row:
                messages = row["messages"]
                if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                             for m in messages):
                    raise ValueError(f'{path}:{lineno}: "messages" must be a list of {{"role", "content"}}')
                row["token_ids"] = chat.prompt_ids(messages)
            else:
                row["token_ids"] = chat.encode(str(row["text"]))
        ids = row["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{path}:{lineno}: token_ids must be a list of ints")
        key = str(row["id"])
        if key in seen:
            raise ValueError(f"{path}:{lineno}: duplicate id {key!r}")
        seen.add(key)
        prompts.append((row["id"], ids))
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _text_ids(path: Path) -> set[str]:
    """The ids of the prompts given as text or messages (their samples are decoded too)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {str(r["id"]) for r in rows if "token_ids" not in r}


def _chat_format(model_dir: str | None):
    from transformers import AutoTokenizer

    from hybridrl.agent.chat import ChatFormat

    if model_dir is None:
        raise ValueError("text prompts need the model's tokenizer")
    return ChatFormat(AutoTokenizer.from_pretrained(model_dir))


async def _generate_all(engine, prompts, sampling, n: int) -> list[dict]:
    from tqdm import tqdm

    results: list[dict] = []
    with tqdm(total=len(prompts) * n, desc="generate", unit="req", file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        async def one(pid, ids, k):
            out = await engine.generate(ids, sampling, f"{pid}/{k}")
            bar.update(1)
            return {"id": pid, "sample": k, "token_ids": out.token_ids, "logprobs": out.logprobs,
                    "finish_reason": out.finish_reason.value, "policy_version": out.policy_version}

        results = await asyncio.gather(*[one(pid, ids, k) for pid, ids in prompts for k in range(n)])
    return list(results)


def main(args: argparse.Namespace) -> int:
    from hybridrl.config import ConfigError, load_config
    from hybridrl.rollout.protocol import SamplingParams

    try:
        cfg = load_config(args.config, args.overrides).rollout.native
    except ConfigError as err:
        print(f"hybridrl: {err}", file=sys.stderr)
        return EXIT_USAGE
    try:
        prompts = read_prompts(Path(args.input), args.model)
        if args.n < 1:
            raise ValueError(f"--n must be >= 1, got {args.n}")
        sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos)
    except (ValueError, OSError) as err:
        print(f"hybridrl generate: {err}", file=sys.stderr)
        return EXIT_USAGE
    from dataclasses import replace

    from hybridrl.backends.native import NativeEngine

    engine = NativeEngine.from_pretrained(args.model, replace(cfg, seed=args.seed), device=args.device)
    try:
        rows = asyncio.run(_generate_all(engine, prompts, sampling, args.n))
    except ValueError as err:
        print(f"hybridrl generate: {err}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        engine.close()
    texts = _text_ids(Path(args.input))
    if texts:
        chat = _chat_format(args.model)
        for row in rows:
            if str(row["id"]) in texts:
                row["text"] = chat.decode(row["token_ids"])
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tokens = sum(len(r["token_ids"]) for r in rows)
    print(f"wrote {len(rows)} samples ({tokens} tokens) to {out}", file=sys.stderr)
    return 0
