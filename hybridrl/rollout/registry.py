"""Rollout engines by name (`rollout.engine`): one declared row each, its engine imported only when built.

A row (`RolloutEngineSpec`, in the backend's folder: `backends/<name>/row.py`) holds the engine class,
the class of its config section (`rollout.<name>`) and what the rest of the system needs to know of
it, as fields: the config checks, the workers and the publisher read the row, never the class. The
engine class implements `rollout.protocol.RolloutEngine` and `for_rank(cfg, ctx)` (this rank's
engine for the run: it loads or reserves weights).

A new engine is its folder (engine, config, row) and one line in `ENGINES`. Import-light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from hybridrl.registry import Lazy, Registry


def never(cfg: Any) -> bool:
    return False


def no_check(cfg: Any) -> None:
    return None


def no_clock(engine: Any) -> None:
    return None


def serves_any(model_dir: str) -> None:
    return None


@dataclass(frozen=True)
class RolloutEngineSpec:
    """One rollout engine."""

    name: str
    engine: Lazy                       # the engine class: for_rank(cfg, ctx) -> this rank's engine
    config: type                       # its section, `rollout.<name>`
    # how a trainer in the same process delivers flat buckets (`publication.transport.WeightTransport`) to this
    # rank's engine, or its stand-in on the other ranks of a rollout tensor-parallel group: (engine, ranks, group)
    colocated_transport: Callable[[Any, Sequence[int], Any], Any]
    # the memory tags an engine of this run releases (the stand-in of a rollout tensor-parallel group mirrors them)
    releasable_tags: Callable[[Any], frozenset]
    serves_before_publication: bool    # False: it starts without weights (version -1) until the first publication
    reads_back_weights: bool           # it hashes its own storage after a copy (publish.verify=post_copy)
    remote_publication: bool           # a rollout rank of a placement with the roles apart can run it
    # a publication of this run (cfg) carries the LoRA adapters only: the engine applies them itself
    adapter_publication: Callable[[Any], bool] = never
    # a received GPU bucket goes whole to its `load_bucket(bucket, version, names=, digests=)` (one flat buffer,
    # not one tensor at a time through `update_weights`)
    loads_flat_buckets: bool = False
    # model.path -> why this engine cannot serve that HF directory (None: it can); preflight refuses the run
    model_problem: Callable[[str], "str | None"] = serves_any
    # this rank's engine -> its step clock (`agent.collector.StepClock`) when its steps run on the caller's
    # event loop, so that partial collection slices by steps, not seconds; else None
    step_clock: Callable[[Any], Any] = no_clock
    # an engine of this run (cfg) takes a publication while requests run, without draining them: it applies
    # the weights between two of its steps and continues each request as a new segment of the new version
    updates_in_flight: Callable[[Any], bool] = never
    summary: str = ""                  # what `rollout.engine`'s help says of it
    section_help: str = ""             # the help of its sub-section
    single_rank: str = ""              # why it needs rollout.tp=1 (empty: any tensor-parallel size)
    # what its section needs of the rest of the run (cfg): raises ConfigValueError naming the key, at load
    check_run: Callable[[Any], None] = no_check
    # an engine of this run (cfg) serves a colocated trainer's parameters in place: the mode switch lends it
    # `actor.hf_views()` once (`engine.share_weights`)
    shares_trainer_weights: Callable[[Any], bool] = never


ENGINES: Registry[RolloutEngineSpec] = Registry("rollout engine", key="engine", row=RolloutEngineSpec, shipped={
    "native": "hybridrl.backends.native.row:ENGINE",
    "sglang": "hybridrl.backends.sglang.row:ENGINE",
    "vllm": "hybridrl.backends.vllm.row:ENGINE",
    "replicas": "hybridrl.backends.replicas.row:ENGINE",
})


def engine_row(name: str) -> RolloutEngineSpec:
    return ENGINES.get(name, key="rollout.engine")
