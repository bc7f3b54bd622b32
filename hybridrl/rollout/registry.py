"""Rollout engines by name (`rollout.engine`), imported only when built.

An engine class implements `rollout.protocol.RolloutEngine` and, for the workers, four members:

    Engine.for_rank(cfg, ctx)              this rank's engine for the run (it loads or reserves weights)
    Engine.releasable_tags_for(cfg)        the memory tags an engine of this run releases (the stand-in
                                           of a rollout tensor-parallel group mirrors them)
    Engine.serves_before_publication       False: it starts without weights (version -1) until the first
                                           publication
    Engine.colocated_transport(engine, ranks, group)   how a trainer in the same process delivers flat
                                           buckets (`publication.transport.WeightTransport`) to this rank's
                                           engine, or its stand-in on the other ranks of a rollout
                                           tensor-parallel group (`ranks`, `group`)

A new engine is its backend module(s), its config section and one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

ENGINES = {
    "native": "hybridrl.backends.native.engine:NativeEngine",
    "sglang": "hybridrl.backends.sglang.engine:SGLangEngine",
    "vllm": "hybridrl.backends.vllm.engine:VLLMEngine",
}


def engine_class(name: str) -> Any:
    if name not in ENGINES:
        raise ValueError(f"rollout.engine={name!r}: no such rollout engine (known: {sorted(ENGINES)})")
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)
