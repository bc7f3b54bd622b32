"""`GroupQueue`: a bounded FIFO of complete groups (the trajectories of one prompt travel together).

Bounded three ways: groups, trajectories' tokens, and bytes (an estimate: 8 bytes for each entry of
a trajectory's per-token lists, prompt and response, 4 lists). A group that does not fit is
handled by the queue's policy:

    block        `put` waits (a thread producer) until the consumer has made room, or until its
                 `timeout`, then raises `QueueFull`; a single-threaded producer asks `room()` and
                 produces no more than that (the partial-rollout controller launches fewer groups).
    drop_oldest  the oldest groups are dropped until the new one fits; every drop is counted
                 (`dropped_groups`, `dropped_trajectories`, `dropped_tokens`).

A group larger than the bounds on its own is refused either way (`ValueError`): no policy can
hold it.
"""

from __future__ import annotations

import collections
import threading
from typing import Sequence

from hybridrl.data.trajectory import Trajectory

POLICIES = ("block", "drop_oldest")


class QueueFull(Exception):
    pass


def group_tokens(group: Sequence[Trajectory]) -> int:
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in group)


def group_bytes(group: Sequence[Trajectory]) -> int:
    return sum(8 * (len(t.prompt_ids) + 4 * len(t.response_ids)) for t in group)


class GroupQueue:
    def __init__(self, *, max_groups: int, max_tokens: int = 0, max_bytes: int = 0, policy: str = "block"):
        if policy not in POLICIES:
            raise ValueError(f"queue policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups}")
        self.max_groups, self.max_tokens, self.max_bytes, self.policy = max_groups, max_tokens, max_bytes, policy
        self._items: collections.deque[list[Trajectory]] = collections.deque()
        self.tokens = 0
        self.bytes = 0
        self._cond = threading.Condition()
        self.counts = {"put_groups": 0, "got_groups": 0, "dropped_groups": 0, "dropped_trajectories": 0,
                       "dropped_tokens": 0, "blocked": 0}
        self.peak = {"groups": 0, "tokens": 0, "bytes": 0}

    def __len__(self) -> int:
        return len(self._items)

    def room(self) -> int:
        """Groups that can still enter without a drop or a wait (by the group bound)."""
        with self._cond:
            return self.max_groups - len(self._items)

    def _fits(self, tokens: int, nbytes: int) -> bool:
        return (len(self._items) < self.max_groups
                and (not self.max_tokens or self.tokens + tokens <= self.max_tokens)
                and (not self.max_bytes or self.bytes + nbytes <= self.max_bytes))

    def put(self, group: list[Trajectory], timeout: float | None = None) -> None:
        tokens, nbytes = group_tokens(group), group_bytes(group)
        if (self.max_tokens and tokens > self.max_tokens) or (self.max_bytes and nbytes > self.max_bytes):
            raise ValueError(f"a group of {tokens} tokens / {nbytes} bytes exceeds the queue's bounds "
                             f"(max_tokens={self.max_tokens}, max_bytes={self.max_bytes}) on its own")
        with self._cond:
            if not self._fits(tokens, nbytes):
                if self.policy == "drop_oldest":
                    while not self._fits(tokens, nbytes):
                        old = self._pop()
                        self.counts["dropped_groups"] += 1
                        self.counts["dropped_trajectories"] += len(old)
                        self.counts["dropped_tokens"] += group_tokens(old)
                else:
                    self.counts["blocked"] += 1
                    if not self._cond.wait_for(lambda: self._fits(tokens, nbytes), timeout):
                        raise QueueFull(f"no room for a group of {tokens} tokens within {timeout}s")
            self._items.append(group)
            self.tokens += tokens
            self.bytes += nbytes
            self.counts["put_groups"] += 1
            self.peak = {"groups": max(self.peak["groups"], len(self._items)),
                         "tokens": max(self.peak["tokens"], self.tokens), "bytes": max(self.peak["bytes"], self.bytes)}

    def get(self, n: int) -> list[list[Trajectory]]:
        """Up to `n` groups, oldest first (never waits)."""
        with self._cond:
            out = [self._pop() for _ in range(min(n, len(self._items)))]
            self.counts["got_groups"] += len(out)
            self._cond.notify_all()
            return out

    def _pop(self) -> list[Trajectory]:
        group = self._items.popleft()
        self.tokens -= group_tokens(group)
        self.bytes -= group_bytes(group)
        return group

    def state(self) -> list[list[Trajectory]]:
        """The queued groups (for a checkpoint), oldest first."""
        with self._cond:
            return [list(g) for g in self._items]
