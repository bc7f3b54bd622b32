"""Training engines by name (`train.engine`): one declared row each, its code imported only when built.

    build(cfg, role, device)   the actor, the reference (frozen), the critic (a value head) or the
                               teacher of a run; SFT's model is the actor

An engine's row (`TrainEngineSpec`, in its backend's folder: `backends/megatron/row.py`) holds its
class, which provides `from_hf(model_dir, train_cfg, *, training, device, head)` and implements
`training.protocol.TrainEngine`, and the class of the `train` section it reads. A new engine is its
folder and one line in `ENGINES`. Import-light (config validation reads the names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.registry import Lazy, Registry

ACTOR, REFERENCE, CRITIC, TEACHER = "actor", "reference", "critic", "teacher"
DEFAULT = "megatron"


@dataclass(frozen=True)
class TrainEngineSpec:
    """One training engine."""

    name: str
    engine: Lazy           # the engine class: from_hf(model_dir, train_cfg, *, training, device, head)
    config: type           # the `train` section (its knobs; `engine` names the row)


ENGINES: Registry[TrainEngineSpec] = Registry("training engine", key="engine", row=TrainEngineSpec, shipped={
    "megatron": "hybridrl.backends.megatron.row:ENGINE",
})


def train_section(engine: str | None = None) -> type:
    """The class of the `train` section: the row's of `engine` (`train.engine`; None: the default engine)."""
    return ENGINES.get(engine or DEFAULT, key="train.engine").config


def engine_class(name: str) -> Any:
    return ENGINES.get(name).engine.resolve()


def build(cfg: Any, role: str, device: Any) -> Any:
    """A training engine of this run: the `actor`, the `reference` (the actor's weights, frozen) or the
    `critic` (`critic.path` or the actor's weights, with a value head and its own optimizer settings) or the
    `teacher` of on-policy distillation (`distill.teacher`, frozen, the actor's layout)."""
    from hybridrl.training.protocol import LM_HEAD, VALUE_HEAD

    cls = engine_class(cfg.train.engine)
    if role == ACTOR:
        actor = cls.from_hf(cfg.model.path, cfg.train, training=True, device=device, head=LM_HEAD)
        if cfg.algo.router_replay != "off":          # MoE: the rollout's recorded experts (engine's set_router_replay)
            actor.set_router_replay(cfg.algo.router_replay)
        return actor
    if role == REFERENCE:
        return cls.from_hf(cfg.model.path, cfg.train, training=False, device=device, head=LM_HEAD)
    if role == CRITIC:
        return cls.from_hf(cfg.critic.path or cfg.model.path, cfg.critic.megatron(cfg.train), training=True,
                           device=device, head=VALUE_HEAD)
    if role == TEACHER:
        return cls.from_hf(cfg.distill.teacher, cfg.train, training=False, device=device, head=LM_HEAD)
    raise ValueError(f"no training role {role!r}")
