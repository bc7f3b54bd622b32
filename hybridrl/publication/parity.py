"""The logprob parity probe run after each publication (train/inference numerical parity on fixed prefixes).

Fixed prefixes (seeded, the same on every rank and every step) are decoded greedily by the
rollout engine; the trainer recomputes the logprobs of the same sequences; the two are compared
at the generated positions. Greedy logprobs under the sampler contract are log_softmax(logits)
at temperature 1, exactly what `compute_logprobs(temperature=1.0)` returns.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridrl.data.batch import Batch, pad_sequences
from hybridrl.rollout.protocol import GenerationOutput, SamplingParams


def probe_prompts(vocab_size: int, num_prompts: int, length: int = 12, seed: int = 1234,
                  avoid: Sequence[int] = ()) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    banned = torch.tensor(sorted(set(avoid)), dtype=torch.long)
    prompts = []
    for i in range(num_prompts):
        ids = torch.randint(0, vocab_size, (length + i,), generator=g)
        if banned.numel():
            ids = torch.where(torch.isin(ids, banned), (ids + 1) % vocab_size, ids)
        prompts.append(ids.tolist())
    return prompts


async def engine_outputs(engine, prompts: list[list[int]], num_tokens: int, tag: str) -> list[GenerationOutput]:
    """The engine's greedy generations of `prompts`, requested together (one batch: `num_tokens` decode
    steps for all of them, not for each in turn)."""
    import asyncio

    sampling = SamplingParams(max_new_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return list(await asyncio.gather(*(engine.generate(p, sampling, f"parity-{tag}-{i}")
                                       for i, p in enumerate(prompts))))


def probe_batch(prompts: list[list[int]], outputs: list[GenerationOutput]) -> Batch:
    rows = [p + o.token_ids for p, o in zip(prompts, outputs)]
    ids = pad_sequences(rows)
    mask = pad_sequences([[1] * len(r) for r in rows])
    return Batch({"input_ids": ids, "attention_mask": mask})


def compare(prompts: list[list[int]], outputs: list[GenerationOutput], trainer_logprobs: torch.Tensor) -> dict[str, float]:
    """trainer_logprobs [B, T] token-aligned; returns max / mean abs difference over generated tokens."""
    diffs = []
    for b, (p, o) in enumerate(zip(prompts, outputs)):
        mine = trainer_logprobs[b, len(p): len(p) + len(o.token_ids)]
        diffs.append((mine - torch.tensor(o.logprobs, dtype=mine.dtype)).abs())
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    return {"parity/max_abs": float(d.max()) if d.numel() else 0.0,
            "parity/mean_abs": float(d.mean()) if d.numel() else 0.0, "parity/tokens": float(d.numel())}


class ProbeSchedule:
    """Which publications the parity probe checks (`publish.parity_every`): a process's first one (a
    fresh engine, a resumed run) and every version that is a multiple of `every`. Both ends of a
    publication decide alike from the version alone, so the sender and the receivers always agree."""

    def __init__(self, every: int):
        self.every, self.first = max(int(every), 1), True

    def due(self, version: int) -> bool:
        due = self.first or version % self.every == 0
        self.first = False
        return due
