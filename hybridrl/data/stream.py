"""A resumable stream over a task's train split: seeded reshuffle per epoch, a cursor to checkpoint."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


@dataclass
class Cursor:
    epoch: int = 0
    position: int = 0


class ShuffledStream(Generic[T]):
    def __init__(self, items: Sequence[T], seed: int, cursor: Cursor | None = None):
        if not items:
            raise ValueError("cannot stream an empty split")
        self.items = list(items)
        self.seed = seed
        self.cursor = cursor or Cursor()
        self._order = self._permutation(self.cursor.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(f"{self.seed}/epoch{epoch}").shuffle(order)
        return order

    def next(self, n: int) -> list[T]:
        out = []
        while len(out) < n:
            if self.cursor.position == len(self.items):
                self.cursor = Cursor(self.cursor.epoch + 1, 0)
                self._order = self._permutation(self.cursor.epoch)
            out.append(self.items[self._order[self.cursor.position]])
            self.cursor.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.cursor.epoch, "position": self.cursor.position}

    # a stateful part of a run's checkpoint (`store.checkpoints.Checkpointer`)
    def state_dict(self) -> dict:
        return self.state()

    def load_state_dict(self, state: dict) -> None:
        self.cursor = Cursor(**state)
        self._order = self._permutation(self.cursor.epoch)
