"""`Publication`: which tensors of a pending policy version have arrived at an engine.

A version becomes current only once every tensor of the engine's weight spec has arrived for it
(a publication streams in several buckets); a newer version supersedes an incomplete one.
"""

from __future__ import annotations

from typing import Iterable


class Publication:
    def __init__(self, names: Iterable[str], version: int):
        self.names = frozenset(names)
        self.version = version
        self._pending: dict[int, set[str]] = {}

    def completes(self, names: Iterable[str], version: int) -> bool:
        """Whether these arrivals would complete `version` (to act just before it becomes current)."""
        return set(names) | self._pending.get(version, set()) >= self.names

    def arrive(self, names: Iterable[str], version: int) -> bool:
        """Record arrivals for `version`; True (and the version becomes current) once all are in."""
        if self._pending and version < max(self._pending):
            raise ValueError(f"v{version} arrived after v{max(self._pending)} started: publications go forward")
        self._pending = {version: self._pending.get(version, set())}
        arrived = self._pending[version]
        arrived.update(names)
        if arrived >= self.names:
            self.version = version
            self._pending = {}
            return True
        return False
