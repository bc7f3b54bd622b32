"""PPO mini-batches of a rollout batch, laid out so that data-parallel ranks hold them in step.

The admitted batch of N sequences is cut into k mini-batches of (nearly) equal sequence counts
(consecutive rows: a group's samples stay together where they can). Each mini-batch is one
optimizer step with its own global loss denominators. With D data-parallel ranks, mini-batch j
is split into D parts of L_j = ceil(|j| / D) rows each (filler rows make up the difference), and
rank r's share of the whole batch is [part (0, r), part (1, r), ...]: the contiguous chunks a
data-parallel split hands out. Every rank then holds L_j rows of mini-batch j at the same
offset, and the union over ranks of those rows is mini-batch j whatever D is: the same global
mini-batches, hence the same updates, at any data-parallel size (and any micro-batch size).

Filler rows copy a real row with a zero loss mask, group index -1 and reward 0: they add nothing
to a loss, a denominator or a group statistic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.data.batch import Batch

FILLER = -1


@dataclass(frozen=True)
class MiniBatchLayout:
    order: list[int]          # position in the laid-out batch -> source row (FILLER for a filler)
    rows_per_rank: list[int]  # mini-batch j: rows each data-parallel rank holds (L_j)
    dp: int

    @property
    def real_positions(self) -> list[int]:
        return [i for i, src in enumerate(self.order) if src != FILLER]


def plan(num_rows: int, dp: int, mini_batches: int) -> MiniBatchLayout:
    """The layout of `num_rows` sequences as `mini_batches` mini-batches over `dp` ranks (a batch
    smaller than `mini_batches` gets one mini-batch per sequence)."""
    if num_rows < 1 or dp < 1 or mini_batches < 1:
        raise ValueError(f"need num_rows, dp, mini_batches >= 1, got {num_rows}, {dp}, {mini_batches}")
    k = min(mini_batches, num_rows)
    bounds = [num_rows * j // k for j in range(k + 1)]
    rows = [-(-(bounds[j + 1] - bounds[j]) // dp) for j in range(k)]
    order: list[int] = []
    for r in range(dp):
        for j in range(k):
            members = list(range(bounds[j], bounds[j + 1]))[r * rows[j]:(r + 1) * rows[j]]
            order += members + [FILLER] * (rows[j] - len(members))
    return MiniBatchLayout(order, rows, dp)


def lay_out(batch: Batch, layout: MiniBatchLayout) -> Batch:
    """`batch`'s rows in `layout.order`, fillers as described above (needs 'loss_mask'; zeroes
    'reward' and sets 'group_index' to -1 on fillers where the batch has them)."""
    order = torch.tensor(layout.order, dtype=torch.long)
    filler = order == FILLER
    out = batch.select(torch.where(filler, torch.zeros_like(order), order))
    for name, value in (("loss_mask", 0), ("reward", 0), ("group_index", FILLER)):
        if name in out.tensors:
            t = out.tensors[name]
            out.tensors[name] = torch.where(filler.view(-1, *([1] * (t.dim() - 1))), torch.full_like(t, value), t)
    return out


def mini_batch_slices(rows_per_rank: list[int]) -> list[tuple[int, int]]:
    """[(start, stop)] of each mini-batch in one rank's share."""
    out, start = [], 0
    for n in rows_per_rank:
        out.append((start, start + n))
        start += n
    return out
