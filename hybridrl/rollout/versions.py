"""`Publication`: the one version tracker of every engine (native, SGLang, the follower stand-in).

A policy version streams into an engine in several buckets. It becomes current only once every
tensor of the engine's weight spec has arrived for it, and an engine that verifies what it
received (its own storage read back after the copy) reports a tensor as arrived only once it
verified, so the version never switches to unverified weights. A newer version supersedes an
incomplete one; an older one is refused. Releasing the weights (`forget`) leaves version -1:
nothing to serve until a whole version arrives again.
"""

from __future__ import annotations

from typing import Iterable

NO_WEIGHTS = -1


class Publication:
    def __init__(self, names: Iterable[str], version: int):
        self.names = frozenset(names)
        self.version = version
        self.pending: int | None = None         # a version in progress (incomplete)
        self._arrived: set[str] = set()

    def check(self, version: int) -> None:
        """Refuse a version older than the current one or than the one in progress."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version must be an int >= 0, got {version!r}")
        floor = self.pending if self.pending is not None else self.version
        if version < floor:
            what = "an update in progress" if self.pending is not None else "the current policy"
            raise ValueError(f"update_weights: version {version} is older than {what} (version {floor})")

    def completes(self, names: Iterable[str], version: int) -> bool:
        """Whether these arrivals would complete `version` (to act just before it becomes current)."""
        arrived = self._arrived if self.pending == version else set()
        return set(names) | arrived >= self.names

    def arrive(self, names: Iterable[str], version: int) -> bool:
        """Record (verified) arrivals for `version`; True once all are in and the version is current."""
        self.check(version)
        if self.pending != version:
            self.pending, self._arrived = version, set()
        self._arrived.update(names)
        if self._arrived >= self.names:
            self.version, self.pending, self._arrived = version, None, set()
            return True
        return False

    def forget(self) -> None:
        """The engine dropped its weights: no version is held until a whole one arrives."""
        self.version, self.pending, self._arrived = NO_WEIGHTS, None, set()
