"""`Mesh`: a named layout of ranks along axes (e.g. pp x dp x tp), outermost axis first.

The training mesh follows Megatron's default rank order (tp fastest, then dp, then pp), so the
coordinates here agree with `megatron.core.parallel_state`. The rollout mesh of the hybrid
worker is a different layout over the same ranks; in a disaggregated placement it lies over the
rollout ranks only (`first`: the job rank of its position 0). Meshes are pure arithmetic: every rank
computes the same ones from the config, and the controller needs no communication to know them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Mesh:
    name: str
    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    dp_axis: str = "dp"
    last_owns_output: tuple[str, ...] = ("pp",)  # along these axes the last index holds outputs
    first: int = 0                               # the job rank at mesh position 0 (ranks are contiguous)

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.sizes):
            raise ValueError(f"mesh '{self.name}': {len(self.axes)} axes but {len(self.sizes)} sizes")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"mesh '{self.name}': repeated axis in {self.axes}")
        if any(s < 1 for s in self.sizes):
            raise ValueError(f"mesh '{self.name}': sizes must be >= 1, got {self.sizes}")
        if self.dp_axis not in self.axes:
            raise ValueError(f"mesh '{self.name}': dp axis '{self.dp_axis}' not in {self.axes}")

    @staticmethod
    def flat(name: str, world_size: int) -> "Mesh":
        """Every rank its own data-parallel member."""
        return Mesh(name, ("dp",), (world_size,))

    @property
    def world_size(self) -> int:
        """How many ranks the mesh holds."""
        return math.prod(self.sizes)

    @property
    def ranks(self) -> list[int]:
        """The job ranks of the mesh, in mesh order."""
        return list(range(self.first, self.first + self.world_size))

    def size(self, axis: str) -> int:
        return self.sizes[self.axes.index(axis)] if axis in self.axes else 1

    @property
    def dp_size(self) -> int:
        return self.size(self.dp_axis)

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of job rank `rank` (every method takes and returns job ranks)."""
        if not self.first <= rank < self.first + self.world_size:
            raise ValueError(f"rank {rank} outside mesh '{self.name}' (ranks {self.first}..."
                             f"{self.first + self.world_size - 1})")
        rank -= self.first
        out = {}
        for axis, size in zip(reversed(self.axes), reversed(self.sizes)):
            out[axis] = rank % size
            rank //= size
        return {a: out[a] for a in self.axes}

    def rank_of(self, **coords: int) -> int:
        rank = 0
        for axis, size in zip(self.axes, self.sizes):
            c = coords.get(axis, 0)
            if not 0 <= c < size:
                raise ValueError(f"coordinate {axis}={c} outside [0, {size}) in mesh '{self.name}'")
            rank = rank * size + c
        return self.first + rank

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)[self.dp_axis]

    def is_output_rank(self, rank: int) -> bool:
        """The rank that holds the outputs of its data-parallel group (e.g. tp 0 of the last pp stage)."""
        for axis, c in self.coords(rank).items():
            if axis == self.dp_axis:
                continue
            want = self.size(axis) - 1 if axis in self.last_owns_output else 0
            if c != want:
                return False
        return True

    def output_ranks(self) -> list[int]:
        """One output rank per data-parallel index, in dp order."""
        owners = [r for r in self.ranks if self.is_output_rank(r)]
        return sorted(owners, key=self.dp_rank)

    def group_along(self, axis: str, rank: int) -> list[int]:
        """The ranks that differ from `rank` only along `axis` (e.g. its TP group)."""
        c = self.coords(rank)
        return [self.rank_of(**{**c, axis: i}) for i in range(self.size(axis))]

    def groups_along(self, axis: str) -> list[list[int]]:
        """All groups along `axis`, each listed once (what every rank passes to new_group)."""
        seen, groups = set(), []
        for r in self.ranks:
            g = self.group_along(axis, r)
            if g[0] not in seen:
                seen.add(g[0])
                groups.append(g)
        return groups


def train_mesh(world_size: int, tp: int, pp: int) -> Mesh:
    """Mesh("train", ("pp", "dp", "tp")): tp fastest, then dp, then pp (Megatron's default order)."""
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp}*{pp}")
    return Mesh("train", ("pp", "dp", "tp"), (pp, world_size // (tp * pp), tp))
