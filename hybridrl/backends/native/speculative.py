"""Exact speculative decoding by prompt lookup: drafts from the sequence's own context, verified in one forward.

Drafting (`PromptLookup`): the longest suffix n-gram of the sequence (prompt + output so far, `min_n`
<= n <= `max_n`) that occurred earlier in it proposes the tokens that followed its most recent earlier
occurrence (Saxena 2023, "prompt lookup decoding"). Agent episodes copy a lot (tool outputs into answers,
numbers of the question into the working), and a copy costs nothing to draft. The index is built
incrementally: each token adds one n-gram per n, so drafting stays O(new tokens) per step.

Verification: a decoding sequence with drafts d_1..d_k computes k + 1 query rows in the step (its last
token and the drafts, at positions p..p+k) through the same decode path as any other row, and row j's
logits are the target model's next-token distribution given tokens[:p+1] + d_1..d_j. Each row is then
sampled exactly as without drafts: x_j = the engine's draw (temperature, top-k, top-p, inverse CDF with
the uniform of output index num_generated + j; see `sampler.py`). The first a drafts with x_j == d_j are
accepted, and x_a is emitted after them (the correction when a < k, the bonus token when a == k).

Why this is exact: it is the rejection rule of Leviathan et al. 2023 ("Fast Inference from Transformers
via Speculative Decoding", Algorithm 1) for a deterministic draft q = one-hot(d): accept d with
probability min(1, p(d) / q(d)) = p(d), and on rejection sample from norm(max(0, p - q)), which is p with
d removed, renormalised. Coupling both to one uniform realises it: x = F^{-1}(u) equals d with probability
p(d), and given x != d it is distributed as p without d. p here is the distribution after the engine's
temperature / top-k / top-p transform, so the emitted tokens are distributed exactly as the engine's
samples without drafts; more than that, they ARE those samples (same seed, same output index, same
logits up to rounding), so greedy and seeded outputs do not change with `speculative_tokens`. The logprob
of an emitted token is row j's (the target's, per the sampler contract). The KV of rejected drafts is
rolled back: `num_computed` advances over the emitted inputs only and blocks allocated past the
sequence's end are returned; the stale rows left in its last block lie beyond every query's position
and are overwritten before anything reads them, and the prefix cache records computed tokens only.
"""

from __future__ import annotations

from typing import Sequence as Seq


class PromptLookup:
    """The n-gram index of one sequence's tokens (kept on the sequence between steps)."""

    __slots__ = ("min_n", "max_n", "index", "indexed")

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self.index: dict[tuple[int, ...], int] = {}   # n-gram -> end (exclusive) of its latest occurrence
        self.indexed = 0                              # n-grams ending at positions <= this are in the index

    def propose(self, tokens: Seq[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        end = len(tokens)
        lo, hi = self.min_n, self.max_n
        for e in range(max(self.indexed + 1, lo), end):       # every occurrence but the suffix itself
            for n in range(lo, min(hi, e) + 1):
                self.index[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end - 1)
        for n in range(min(hi, end), lo - 1, -1):
            e = self.index.get(tuple(tokens[end - n:]))
            if e is not None:
                return list(tokens[e:e + k])
        return []


class Drafter:
    """`rollout.native.speculative_*`: drafts for a decoding sequence, at most k tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def __call__(self, seq, k: int) -> list[int]:
        if seq.lookup is None:
            seq.lookup = PromptLookup(self.min_n, self.max_n)
        return seq.lookup.propose(seq.tokens, k)


def accepted_drafts(target: Seq[int], drafts: Seq[int]) -> int:
    """How many leading drafts are accepted: those equal to the target's own draw at their row (see the
    module doc: this is the rejection rule for a deterministic draft). target has len(drafts) + 1 rows."""
    a = 0
    while a < len(drafts) and target[a] == drafts[a]:
        a += 1
    return a
