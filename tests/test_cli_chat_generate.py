"""Text in, text out: `hybridrl chat MODEL` (the chat template applied, the conversation kept) and
text / chat prompts for `hybridrl generate`; the two agree on the same conversation (greedy)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.launch import ROOT, env_with_repo


def hybridrl(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", *map(str, args)], cwd=ROOT, env=env_with_repo(),
                          capture_output=True, text=True, timeout=300, input=stdin)


def test_chat_and_generate_take_text_and_agree(tiny_models, tmp_path):
    model = tiny_models("qwen2", init_std=0.05)
    chat = hybridrl("chat", model, "--max-new-tokens", "12", "--jsonl", stdin="What is 2 + 3?\n/reset\nWhat is 2 + 3?\nAnd 4 * 5?\n")
    assert chat.returncode == 0, chat.stderr
    replies = [json.loads(line)["reply"] for line in chat.stdout.splitlines()]
    assert len(replies) == 3 and replies[0] == replies[1]          # /reset: the same first turn again, greedy
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": "one", "messages": [{"role": "user", "content": "What is 2 + 3?"}]},
            {"id": "two", "messages": [{"role": "user", "content": "What is 2 + 3?"},
                                       {"role": "assistant", "content": replies[1]},
                                       {"role": "user", "content": "And 4 * 5?"}]},
            {"id": "raw", "text": "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"},
            {"id": "ids", "token_ids": [1, 2, 3]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    gen = hybridrl("generate", "--model", model, "--input", prompts, "--output", out, "--greedy",
                   "--max-new-tokens", "12")
    assert gen.returncode == 0, gen.stderr
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert got["one"]["text"] == replies[0] and got["two"]["text"] == replies[2]   # the chat's turns
    assert got["raw"]["token_ids"] == got["one"]["token_ids"]      # the template rendered = the text given
    assert "text" not in got["ids"] and len(got["ids"]["token_ids"]) >= 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "messages": "hello"}\n')
    wrong = hybridrl("generate", "--model", model, "--input", bad, "--output", out, "--max-new-tokens", "4")
    assert wrong.returncode == 2 and wrong.stderr.strip().endswith(
        '1: "messages" must be a list of {"role", "content"}')
