"""Sampling under the sampler contract (`hybridrl.rollout.protocol.SAMPLER_CONTRACT`), batched.

Small pure functions, one batch of rows (sequences that need a token this step) at a time:

- logprob = log_softmax(logits / T)[token] over the full vocabulary, before top-k / top-p
  (temperature 1 for greedy rows), in float32: the same quantity SGLang returns and the trainer
  recomputes. Under top-k / top-p it is NOT the logprob of the distribution sampled from, so a
  behaviour weight built from it would not be an importance ratio: the objective checks refuse
  algo.tis_cap / algo.mis with agent.top_p < 1 or agent.top_k > 0 (`hybridrl/algo/explain.py`);
  a contract that returned the filtered distribution's logprob would need every engine to;
- greedy = argmax(logits), ties to the lowest id;
- sampling draws from the top-k then top-p filtered, renormalised distribution by inverse CDF
  with ONE uniform per row: u = `uniform(seed, i)`, the i-th output of SplitMix64 seeded with
  the request's seed (i = index of the token in the output). The draw thus depends only on
  (seed, i, logits), never on which other requests share the batch, nor on preemption.

Boundary rules (measure-zero events, documented for reproducibility): top-k keeps every token
whose scaled logit is >= the k-th largest (ties kept); top-p keeps a token iff the probability
mass strictly before it, sorted descending within the top-k renormalised distribution, is
< top_p; the inverse CDF picks the first id whose float64 cumulative probability exceeds
u * total, in vocabulary order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
UNIFORM_BITS = 50


def splitmix64(seed: int, index: int) -> int:
    """The index-th (0-based) output of SplitMix64 seeded with `seed`."""
    z = (seed + _GAMMA * (index + 1)) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def uniform(seed: int, index: int) -> float:
    """A uniform in (0, 1) from the top 50 bits of splitmix64(seed, index): (k + 0.5) / 2**50."""
    return ((splitmix64(seed, index) >> (64 - UNIFORM_BITS)) + 0.5) / float(1 << UNIFORM_BITS)


def request_seed(engine_seed: int, request_id: str) -> int:
    """The seed of a request that brings none: a hash of the engine seed and the request id."""
    digest = hashlib.blake2b(f"{engine_seed}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step. `None` fields mean "the same for every row"."""

    temperature: torch.Tensor | None        # [S] float32; 1.0 on greedy rows; None = all 1.0
    greedy: torch.Tensor | None             # [S] bool; None = no greedy row
    top_k: torch.Tensor | None              # [S] int64, vocab size where off; None = no row filters
    top_p: torch.Tensor | None              # [S] float32, 1.0 where off
    uniforms: torch.Tensor | None           # [S] float64; None = every row greedy
    all_greedy: bool = False

    @classmethod
    def build(cls, rows: Sequence[tuple[float, int, float, int, int]], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        """rows: (temperature, top_k, top_p, seed, output index) per row; temperature 0 = greedy."""
        temps = [r[0] for r in rows]
        greedy = [t == 0.0 for t in temps]
        if all(greedy):
            return cls(temperature=None, greedy=None, top_k=None, top_p=None, uniforms=None, all_greedy=True)
        scaled = [1.0 if t == 0.0 else t for t in temps]
        filtering = any(not g and (r[1] > 0 or r[2] < 1.0) for g, r in zip(greedy, rows))
        return cls(
            temperature=None if all(t == 1.0 for t in scaled) else torch.tensor(scaled, dtype=torch.float32,
                                                                                device=device),
            greedy=torch.tensor(greedy, device=device) if any(greedy) else None,
            # greedy rows ignore the filter (argmax wins below): give them the cheapest one
            top_k=torch.tensor([1 if g else (r[1] if r[1] > 0 else vocab_size) for g, r in zip(greedy, rows)],
                               device=device) if filtering else None,
            top_p=torch.tensor([1.0 if g else r[2] for g, r in zip(greedy, rows)], dtype=torch.float32,
                               device=device) if filtering else None,
            uniforms=torch.tensor([uniform(r[3], r[4]) for r in rows], dtype=torch.float64, device=device),
        )


def top_k_top_p_keep(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k then top-p: scaled [S, V] float32 -> keep [S, V] bool."""
    vocab = scaled.shape[-1]
    k_max = int(top_k.max())
    if k_max < vocab:
        vals, idx = torch.topk(scaled, k_max, dim=-1, sorted=True)          # [S, k_max]
    else:
        vals, idx = torch.sort(scaled, dim=-1, descending=True)             # [S, V]
    kth = vals.gather(1, (top_k.clamp(max=vals.shape[1]) - 1).unsqueeze(1))
    keep_sorted = vals >= kth                                               # ties at the k-th value kept
    if bool((top_p < 1.0).any()):
        probs = vals.masked_fill(~keep_sorted, float("-inf")).softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs                               # mass strictly before each token
        keep_sorted &= (before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
        keep_sorted[:, 0] = True
    return torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, idx, keep_sorted)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] float32 -> (tokens [S] int64, logprobs [S] float32) per the sampler contract."""
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
        return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    scaled = logits if batch.temperature is None else logits / batch.temperature.unsqueeze(1)
    logprobs = torch.log_softmax(scaled, dim=-1)                            # [S, V]
    probs = logprobs.exp()
    if batch.top_k is not None:
        probs = probs.masked_fill(~top_k_top_p_keep(scaled, batch.top_k, batch.top_p), 0.0)
    cdf = probs.double().cumsum(dim=-1)                                     # [S, V] float64
    target = (batch.uniforms * cdf[:, -1]).unsqueeze(1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    if batch.greedy is not None:
        tokens = torch.where(batch.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
