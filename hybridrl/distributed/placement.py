"""Where the actor trains and where the engines generate: the `placement` section, and what a
placement is.

A placement is data (`Placement`): whether the training and rollout ranks are apart, how a rank's
worker is built (which parts it holds: a training side, a rollout side, the link between them), and
which collection strategy the controller runs. Shipped ones (`controller/placements.py`):

    colocated       (default) every rank holds both sides and switches between them (the hybrid
                    engine): training and generation take turns on the same devices.
    disaggregated   the last `rollout_ranks` ranks hold only rollout sides and generate without
                    pause; the other ranks hold only training sides. After each update the weights
                    travel from training rank 0 to the rollout ranks over a process group. Generation
                    and training overlap, at the price of a policy lag: see `algo.max_policy_lag`.

`placement.mode` names a shipped placement or any `package.module:ATTR` that is a `Placement`.
When roles are apart, ranks 0 .. T-1 train (rank 0 is also the controller) and ranks T .. W-1
generate, T = W - rollout_ranks. Import-light (no torch): config loading and preflight use it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.config.fields import ConfigValueError, check_positive, knob

COLOCATED, DISAGGREGATED = "colocated", "disaggregated"
SHIPPED = {
    COLOCATED: "hybridrl.controller.placements:COLOCATED",
    DISAGGREGATED: "hybridrl.controller.placements:DISAGGREGATED",
}
_SPLIT = {COLOCATED: False, DISAGGREGATED: True}    # known without importing the shipped placements


@dataclass(frozen=True)
class Placement:
    """One row of the placement table."""

    name: str
    split_roles: bool                            # training and rollout ranks apart, each role a world of its own
    build: Callable[[Any, Any], Any]             # (cfg, ctx) -> the rank's worker: its parts and meshes
    collection: Callable[[Any, Any, Any], Any]   # (cfg, worker group, run state) -> how a step collects
    summary: str = ""


def resolve(mode: str) -> Placement:
    """The placement `placement.mode` names (a shipped name, or 'package.module:ATTR')."""
    target = SHIPPED.get(mode, mode)
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"placement.mode={mode!r}: not a shipped placement ({sorted(SHIPPED)}) nor 'module:ATTR'")
    try:
        placement = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"placement.mode={mode!r}: cannot load it ({type(err).__name__}: {err})") from None
    if not isinstance(placement, Placement):
        raise TypeError(f"placement.mode={mode!r} resolves to a {type(placement).__name__}, not a "
                        "hybridrl.distributed.placement.Placement")
    return placement


@dataclass(kw_only=True)
class PlacementConfig:
    """Which ranks train and which generate."""

    mode: str = knob(COLOCATED, "colocated: every rank trains and generates in turn (hybrid engine) | "
                                "disaggregated: the last `rollout_ranks` ranks only generate, continuously, the "
                                "others only train; weights travel to the rollout ranks after each update | "
                                "'package.module:ATTR': a Placement of your own")
    rollout_ranks: int = knob(1, "disaggregated: how many ranks (the last ones) hold the engines")

    def __post_init__(self) -> None:
        if self.mode not in SHIPPED and ":" not in self.mode:
            raise ConfigValueError("mode", f"expected one of {sorted(SHIPPED)} or 'package.module:ATTR', "
                                           f"got {self.mode!r}")
        check_positive("rollout_ranks", self.rollout_ranks)

    @property
    def disaggregated(self) -> bool:
        """The training and rollout ranks are apart (a placement of your own is imported to tell)."""
        return _SPLIT[self.mode] if self.mode in _SPLIT else resolve(self.mode).split_roles

    def resolve(self) -> Placement:
        return resolve(self.mode)


@dataclass(frozen=True)
class Roles:
    """The job's ranks by role: `train` ranks [0, num_train), `rollout` ranks [num_train, world)."""

    world_size: int
    num_train: int               # == world_size when colocated (every rank does both)

    @staticmethod
    def of(cfg: PlacementConfig, world_size: int) -> "Roles":
        if not cfg.disaggregated:
            return Roles(world_size, world_size)
        problem = placement_problem(cfg, world_size)
        if problem:
            raise ValueError(problem)
        return Roles(world_size, world_size - cfg.rollout_ranks)

    @property
    def disaggregated(self) -> bool:
        return self.num_train < self.world_size

    @property
    def train_ranks(self) -> list[int]:
        return list(range(self.num_train))

    @property
    def rollout_ranks(self) -> list[int]:
        return list(range(self.num_train, self.world_size)) if self.disaggregated else list(range(self.world_size))

    def role(self, rank: int) -> str:
        if not self.disaggregated:
            return "hybrid"
        return "train" if rank < self.num_train else "rollout"


def placement_problem(cfg: PlacementConfig, world_size: int, *, world_key: str = "the world size") -> str | None:
    """Why this placement cannot run on `world_size` ranks, as one line naming the key; None if it can."""
    if cfg.disaggregated and cfg.rollout_ranks >= world_size:
        return (f"placement.rollout_ranks={cfg.rollout_ranks}: a disaggregated placement needs at least one "
                f"training rank, and {world_key} is {world_size} (use placement.rollout_ranks <= {world_size - 1}, "
                f"or more ranks)")
    return None
