"""Tiny models whose behaviour a test controls, for the learning-signal tests: a few hundred plain
transformers steps on a task's demonstrations, laid out as SFT lays them out (`ChatFormat.
conversation_ids`: the loss on the assistant's tokens and their EOS only)."""

from __future__ import annotations

import shutil
from pathlib import Path


def warm_start(base: Path, out: Path, task_name: str, *, steps: int = 150, demos: int = 64, lr: float = 3e-3,
               seed: int = 0) -> Path:
    """`base` fine-tuned on `demos` of the task's demonstrations for `steps` AdamW steps -> `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hybridrl.agent.chat import ChatFormat
    from hybridrl.config import load_config
    from hybridrl.envs.tasks import get_task

    cfg = load_config(None, [f"task.name={task_name}", f"model.path={base}"])
    tokenizer = AutoTokenizer.from_pretrained(base)
    chat = ChatFormat(tokenizer)
    rows = [chat.conversation_ids(c) for c in get_task(cfg.task.name, cfg.task).sft_demonstrations(demos)]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows], dtype=torch.float32)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        rows_now = torch.randperm(len(rows))[:16]
        logits = model(input_ids=ids[rows_now]).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[rows_now, 1:, None])[..., 0]
        m = mask[rows_now, 1:]
        loss = -(logp * m).sum() / m.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out)
    for f in Path(base).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation")):
            shutil.copy(f, out / f.name)
    return out
