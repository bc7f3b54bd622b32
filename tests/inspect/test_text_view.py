"""`hybridrl inspect RUN TRAJECTORY` shows the episode itself: the prompt, every turn the policy
wrote and every tool output, in order (a user debugging an episode reads these first)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.inspect.test_trace import CALC_TURNS, run_step, tokenizer  # noqa: F401 - the fixture
from tests.launch import ROOT, env_with_repo


def test_the_text_view_shows_prompt_turns_and_tool_output(tmp_path, tokenizer):  # noqa: F811
    _, _, trajs, _ = run_step(tmp_path, tokenizer)
    right = trajs[0]
    out = subprocess.run([sys.executable, "-m", "hybridrl", "inspect", str(tmp_path), right.trace_id],
                         cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    episode = text[text.index("episode:"): text.index("1. policy and sampler")]
    assert "  prompt:\n" in episode and "   | What is 2 + 3?" in episode
    blocks = [b for b in re.split(r"\n  (?=\S)", episode) if b.startswith("turn ")]
    policy = [b for b in blocks if "the policy" in b]
    observed = [b for b in blocks if "tool / environment output" in b]
    assert len(policy) == 5 and len(observed) == 4                # five turns, a tool message after each call
    for written, block in zip(CALC_TURNS, policy):
        assert written in "".join(line[5:] for line in block.splitlines()[1:])
    assert "   | 5" in observed[3]                                  # the calculator's result of 2 + 3
    assert "not available" in observed[1]                           # the refused python call's message
    order = [episode.index(b) for b in blocks]
    assert order == sorted(order)
    assert "answer: '5'; reward 1" in episode
