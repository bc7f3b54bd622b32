"""Config of the process layout and the control plane."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import check_choice, check_positive, knob


@dataclass(kw_only=True)
class DistributedConfig:
    """Processes, devices and the control plane (timeouts, heartbeats)."""

    nproc_per_node: int = knob(1, "ranks per node that `hybridrl train` starts with torchrun")
    device: str = knob("auto", "auto (CUDA when present, else CPU) | cpu | cuda")
    call_timeout_s: float = knob(1800.0, "a worker-group call that runs longer than this fails the run")
    heartbeat_interval_s: float = knob(0.5, "how often every rank signals it is alive")
    heartbeat_timeout_s: float = knob(30.0, "a rank silent for this long is declared dead")
    init_timeout_s: float = knob(300.0, "process-group initialisation timeout")
    error_grace_s: float = knob(
        3.0, "after a rank fails, how long the controller waits for the others to report before aborting"
    )
    socket_ifname: str = knob(
        "", "network interface the job's traffic uses (gloo: GLOO_SOCKET_IFNAME; NCCL's bootstrap: "
            "NCCL_SOCKET_IFNAME unless set; under SLURM the rendezvous and the control plane's store too); "
            "empty: the address the hostname resolves to"
    )

    def __post_init__(self) -> None:
        check_positive("nproc_per_node", self.nproc_per_node)
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        for name in ("call_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s", "init_timeout_s"):
            check_positive(name, getattr(self, name))
        check_positive("error_grace_s", self.error_grace_s, allow_zero=True)
