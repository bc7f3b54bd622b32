"""The `hybrid` section: how the colocated worker shares one device between training and rollout."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import knob


@dataclass(kw_only=True)
class HybridConfig:
    """Mode-switch behaviour of the hybrid worker."""

    spill_optimizer: bool = knob(
        False, "on a CPU device, write optimizer state to <run.dir>/offload during rollout and free it (the "
               "rollout phase then holds no optimizer memory; costs a file write + read per switch). On GPUs "
               "optimizer state always moves to pinned host memory.")
