"""The `hybrid` section: how the colocated worker shares one device between training and rollout."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import check_positive, knob

SWITCH_PHASES = ("offload", "publish", "wake", "sleep", "reload")


@dataclass(kw_only=True)
class HybridConfig:
    """Mode-switch behaviour of the hybrid worker."""

    spill_optimizer: bool = knob(
        False, "on a CPU device, write optimizer state to <run.dir>/offload during rollout and free it and the "
               "gradient buffers (the rollout phase then holds neither; costs a file write + read and the "
               "buffers' re-creation per switch; off, both stay in the process). On GPUs optimizer state "
               "always moves to pinned host memory and the gradient buffers are released.")
    offload_deadline_s: float = knob(300.0, "deadline of the offload phase (optimizer state and gradients "
                                            "leave the device); past it the run fails naming the rank")
    publish_deadline_s: float = knob(600.0, "deadline of publishing the weights into the rollout engine")
    wake_deadline_s: float = knob(300.0, "deadline of waking the rollout engine (its KV cache and the rest "
                                         "of its memory)")
    sleep_deadline_s: float = knob(300.0, "deadline of putting the rollout engine to sleep (abort, drain, release)")
    reload_deadline_s: float = knob(300.0, "deadline of bringing optimizer state and gradients back")
    drain_deadline_s: float = knob(60.0, "how long an engine going to sleep waits for its aborted requests to "
                                         "end before it gives up with an error (it never releases memory "
                                         "under a request still running)")

    def __post_init__(self) -> None:
        for phase in (*SWITCH_PHASES, "drain"):
            check_positive(f"{phase}_deadline_s", getattr(self, f"{phase}_deadline_s"))

    def deadlines(self) -> dict[str, float]:
        return {phase: getattr(self, f"{phase}_deadline_s") for phase in SWITCH_PHASES}
