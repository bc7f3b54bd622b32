"""Where the actor trains and where the engines generate: the `placement` section, and what a
placement is.

A placement is a declared row (`Placement`): whether the training and rollout ranks are apart, how a
rank's worker is built (which parts it holds: a training side, a rollout side, the link between
them: `controller/placements.py`), which collection strategy the controller runs, and what it needs
of the other config sections (`check`). The shipped rows (`PLACEMENTS`, below):

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

from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.config.fields import ConfigValueError, check_positive, knob
from hybridrl.registry import Lazy, Registry

COLOCATED, DISAGGREGATED = "colocated", "disaggregated"


def no_check(cfg: Any) -> None:
    """A placement that needs nothing of the other sections."""


@dataclass(frozen=True)
class Placement:
    """One row of the placement table."""

    name: str
    split_roles: bool                            # training and rollout ranks apart, each role a world of its own
    build: Callable[[Any, Any], Any]             # (cfg, ctx) -> the rank's worker: its parts and meshes
    collection: Callable[[Any, Any, Any], Any]   # (cfg, worker group, run state) -> how a step collects
    summary: str = ""
    check: Callable[[Any], None] = no_check      # (the whole config) -> None, or a ConfigValueError naming a key

    def validate(self, cfg: Any) -> None:
        """What this placement needs of the other sections: split roles' needs, then its own `check`."""
        if self.split_roles:
            check_split_roles(cfg)
        self.check(cfg)


def check_split_roles(cfg: Any) -> None:
    """What training and rollout ranks apart need of the other sections, each refusal naming its key."""
    if cfg.run.colocated_only:
        raise ConfigValueError("placement.mode", f"run.job={cfg.run.job} runs colocated: a placement with the "
                                                 "roles apart is for RL (run.job=rl)")
    if cfg.algo.max_policy_lag < 0:
        raise ConfigValueError("algo.max_policy_lag", f"placement.mode={cfg.placement.mode} needs a lag bound: 1 "
                                                      "lets the rollout ranks generate the next step while this one "
                                                      "trains, 0 makes them wait for every update")
    if not cfg.rollout.engine_row.remote_publication:
        raise ConfigValueError("rollout.engine", f"placement.mode={cfg.placement.mode} publishes to engines on their "
                                                 f"own ranks; rollout.engine={cfg.rollout.engine} takes weights from a "
                                                 "colocated trainer only: use another rollout.engine or "
                                                 "placement.mode=colocated")
    if cfg.rollout.tp != 1:
        raise ConfigValueError("rollout.tp", "each rollout rank serves its own engine: set rollout.tp=1")


def check_streaming(cfg: Any) -> None:
    """The disaggregated placement collects continuously (`StreamCollection`)."""
    if cfg.trainer.rollout_mode != "sync":
        raise ConfigValueError("trainer.rollout_mode", "the disaggregated placement collects continuously on its "
                                                       "own: leave trainer.rollout_mode=sync (partial rollouts are "
                                                       "for the colocated placement)")
    if cfg.trainer.dynamic_sampling:
        raise ConfigValueError("trainer.dynamic_sampling", "not available with the disaggregated placement yet: use "
                                                           "placement.mode=colocated")
    if cfg.rollout.engine_row.updates_in_flight(cfg) and cfg.algo.max_policy_lag > 1:
        raise ConfigValueError("algo.max_policy_lag", "with updates that do not drain (rollout.native.on_weight_update"
                                                      "=continue) a publication lands a fixed number of engine steps "
                                                      "after the last grant, which fixes what each version samples "
                                                      "only when no group runs at a grant: set algo.max_policy_lag=1 "
                                                      "(or 0), or on_weight_update=drain")


PLACEMENTS: Registry[Placement] = Registry("placement", key="placement.mode", row=Placement)
PLACEMENTS.register(Placement(
    COLOCATED, split_roles=False, build=Lazy("hybridrl.controller.placements:build_colocated"),
    collection=Lazy("hybridrl.controller.placements:colocated_collection"),
    summary="every rank trains and generates in turn (the hybrid engine)"))
PLACEMENTS.register(Placement(
    DISAGGREGATED, split_roles=True, build=Lazy("hybridrl.controller.placements:build_disaggregated"),
    collection=Lazy("hybridrl.controller.placements:stream_collection"), check=check_streaming,
    summary="training ranks and rollout ranks apart; rollout generates without pause"))


def resolve(mode: str) -> Placement:
    """The placement `placement.mode` names (a shipped name, or 'package.module:ATTR')."""
    return PLACEMENTS.get(mode)


@dataclass(kw_only=True)
class PlacementConfig:
    """Which ranks train and which generate."""

    mode: str = knob(COLOCATED, "colocated: every rank trains and generates in turn (hybrid engine) | "
                                "disaggregated: the last `rollout_ranks` ranks only generate, continuously, the "
                                "others only train; weights travel to the rollout ranks after each update | "
                                "'package.module:ATTR': a Placement of your own")
    rollout_ranks: int = knob(1, "disaggregated: how many ranks (the last ones) hold the engines")

    def __post_init__(self) -> None:
        PLACEMENTS.check("mode", self.mode, load=False)
        check_positive("rollout_ranks", self.rollout_ranks)

    @property
    def disaggregated(self) -> bool:
        """The training and rollout ranks are apart (a placement of your own is imported to tell)."""
        return self.resolve().split_roles

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
