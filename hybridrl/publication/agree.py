"""One decision to publish or refuse, taken together by every rank a publication's collectives span.

A publication's collectives (the trainer's gathers while writing buckets, a transport's gathers and
barriers) span ranks whose checks can differ: the rank that owns a rollout group's engine checks
the engine's own spec (every checkpoint tensor, in the engine's dtype), a rank holding a stand-in
checks the trainer's spec.
Decided alone, the ranks that refuse skip the collectives the others enter, and the group
deadlocks; a rank that accepted after another refused would have to undo what it took.

So every rank computes its own verdict before anything moves (`refusal`), one all-reduce over
every taking part (`agree`) tells each rank which ranks refused, and all take the same branch
(where the reasons already travelled together, e.g. in the votes of the colocated switch's arrival
barrier, `verdict_of` reads the same verdict from them, with no collective):
either every rank publishes, or every rank raises `PublicationRefused` with the same message and
every engine keeps serving what it had. Nothing was copied, so there is nothing to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from hybridrl.rollout.weight_spec import spec_problems


def refusal(published: Mapping[str, tuple[tuple[int, ...], str]], engine: Any) -> str | None:
    """This rank's reason to refuse a publication of `published` ({HF name: (shape, dtype name)}) into
    `engine` (None: it accepts). Looks at nothing but local state. (Whether the engine can read its
    weights back for `publish.verify=post_copy` is its row's `reads_back_weights`, refused at load.)"""
    problems = spec_problems(published.items(), engine.weight_spec())
    return "; ".join(problems) if problems else None


@dataclass(frozen=True)
class Verdict:
    """What the ranks decided: `refused` (publish or not), `refused_by` the job ranks that refused
    (empty for a rank that decided alone), `reason` the first refuser's reason (every rank has it)."""

    refused: bool
    reason: str | None = None
    refused_by: tuple[int, ...] = ()

    def message(self, version: int) -> str:
        plural = "s" if len(self.refused_by) > 1 else ""
        who = f" (by rank{plural} {', '.join(map(str, self.refused_by))})" if self.refused_by else ""
        return f"publication v{version} refused before any copy{who}: {self.reason}"


def local(reason: str | None) -> Verdict:
    """The verdict of a rank that publishes alone (no other rank takes part)."""
    return Verdict(reason is not None, reason)


def verdict_of(reasons: Mapping[int, str | None]) -> Verdict:
    """The verdict when every rank's `refusal` is known ({job rank: reason}, every rank the same mapping)."""
    refused_by = tuple(sorted(rank for rank, reason in reasons.items() if reason is not None))
    return Verdict(True, reasons[refused_by[0]], refused_by) if refused_by else Verdict(False)


def agree(reason: str | None, peers: Any) -> Verdict:
    """Every member of `peers` (a `Peers` over the ranks the publication spans) calls this with its own
    `refusal`; all get the same `Verdict`. One all-reduce of a flag per rank, and when any rank refused,
    one broadcast of the first refuser's reason."""
    flags = torch.zeros(peers.size, dtype=torch.float64)
    if reason is not None:
        flags[peers.ranks.index(peers.me)] = 1.0
    peers.all_reduce(flags, op=dist.ReduceOp.MAX)
    refused_by = tuple(rank for rank, flag in zip(peers.ranks, flags.tolist()) if flag > 0)
    if not refused_by:
        return Verdict(False)
    first = refused_by[0]
    return Verdict(True, peers.broadcast_object(reason if peers.me == first else None, first), refused_by)
