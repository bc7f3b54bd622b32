"""A resumable stream over a task's train split: seeded reshuffle per epoch, a cursor to checkpoint.

One call `next(n)` with n <= len(items) never returns an item twice, even when it crosses an epoch
boundary: the items this call already took from the end of the old epoch are deferred to the end
of the new epoch's permutation (only those that would come up in this call; the cursor records
them, so a resumed stream continues with the same order). Every epoch still holds each item once.
A step's prompts become its groups (`group_id = task_id@step`): a prompt drawn twice in one call
would make one merged group of identical samples with repeated trajectory ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


@dataclass
class Cursor:
    epoch: int = 0
    position: int = 0
    deferred: tuple[int, ...] = field(default_factory=tuple)   # items moved to the end of this epoch's order

    def __post_init__(self) -> None:
        self.deferred = tuple(int(i) for i in self.deferred)


class ShuffledStream(Generic[T]):
    def __init__(self, items: Sequence[T], seed: int, cursor: Cursor | None = None):
        if not items:
            raise ValueError("cannot stream an empty split")
        self.items = list(items)
        self.seed = seed
        self.cursor = cursor or Cursor()
        self._order = self._arranged(self.cursor.epoch, self.cursor.deferred)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
        return order

    def _arranged(self, epoch: int, deferred: Sequence[int]) -> list[int]:
        """The epoch's permutation with the `deferred` items moved to its end (in permutation order)."""
        later = set(deferred)
        order = self._permutation(epoch)
        return [i for i in order if i not in later] + [i for i in order if i in later]

    def _next_epoch(self, taken: set[int], need: int) -> None:
        """Start the next epoch; the items of `taken` (drawn by the current call) that would come up
        among its first `need` positions are deferred to its end."""
        epoch, deferred = self.cursor.epoch + 1, set()
        while True:
            order = self._arranged(epoch, sorted(deferred))
            clash = (set(order[:need]) & taken) - deferred
            if not clash:
                break
            deferred |= clash
        self.cursor = Cursor(epoch, 0, tuple(sorted(deferred)))
        self._order = order

    def next(self, n: int) -> list[T]:
        """The next `n` items; distinct when n <= len(items)."""
        out: list[T] = []
        taken: set[int] = set()
        while len(out) < n:
            if self.cursor.position == len(self.items):
                if len(taken) >= len(self.items):    # n > len(items): repeats are unavoidable from here
                    taken = set()
                self._next_epoch(taken, min(n - len(out), len(self.items)))
            index = self._order[self.cursor.position]
            out.append(self.items[index])
            taken.add(index)
            self.cursor.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.cursor.epoch, "position": self.cursor.position, "deferred": list(self.cursor.deferred)}

    # a stateful part of a run's checkpoint (`store.checkpoints.Checkpointer`)
    def state_dict(self) -> dict:
        return self.state()

    def load_state_dict(self, state: dict) -> None:
        self.cursor = Cursor(**state)
        self._order = self._arranged(self.cursor.epoch, self.cursor.deferred)
