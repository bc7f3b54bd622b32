"""Training engines by name (`train.engine`), imported only when built.

    build(cfg, role, device)   the actor, the reference (frozen) or the critic (a value head) of a run

An engine class provides `from_hf(model_dir, train_cfg, *, training, device, head)` and implements
`training.protocol.TrainEngine`. A new engine is its module and one line here. Import-light (config validation reads `ENGINES`).
"""

from __future__ import annotations

import importlib
from typing import Any

ENGINES = {
    "megatron": "hybridrl.backends.megatron.engine:MegatronEngine",
}

ACTOR, REFERENCE, CRITIC = "actor", "reference", "critic"


def engine_class(name: str) -> Any:
    if name not in ENGINES:
        raise ValueError(f"train.engine={name!r}: no such training engine (known: {sorted(ENGINES)})")
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def build(cfg: Any, role: str, device: Any) -> Any:
    """A training engine of this run: the `actor`, the `reference` (the actor's weights, frozen) or the
    `critic` (`critic.path` or the actor's weights, with a value head and its own optimizer settings)."""
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
    raise ValueError(f"no training role {role!r}")
