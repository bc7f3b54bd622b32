"""Where the actor trains and where the engines generate: the `placement` section.

    colocated       (default) every rank holds the Megatron actor and a rollout engine and switches
                    between them (the hybrid worker): training and generation take turns on the
                    same devices.
    disaggregated   the last `rollout_ranks` ranks hold only engines and agent loops and generate
                    without pause; the other ranks hold only the actor (and reference / critic)
                    and train. After each update the weights travel from training rank 0 to the
                    rollout ranks over a process group. Generation and training overlap, at the
                    price of a policy lag: see `algo.max_policy_lag`.

Ranks 0 .. T-1 train (rank 0 is also the controller), ranks T .. W-1 generate, T = W - rollout_ranks.
Import-light (no torch): config loading and preflight use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import check_choice, check_positive, knob

COLOCATED, DISAGGREGATED = "colocated", "disaggregated"


@dataclass(kw_only=True)
class PlacementConfig:
    """Which ranks train and which generate."""

    mode: str = knob(COLOCATED, "colocated: every rank trains and generates in turn (hybrid engine) | "
                                "disaggregated: the last `rollout_ranks` ranks only generate, continuously, the "
                                "others only train; weights travel to the rollout ranks after each update")
    rollout_ranks: int = knob(1, "disaggregated: how many ranks (the last ones) hold the engines")

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, (COLOCATED, DISAGGREGATED))
        check_positive("rollout_ranks", self.rollout_ranks)

    @property
    def disaggregated(self) -> bool:
        return self.mode == DISAGGREGATED


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
