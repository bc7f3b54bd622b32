"""Faults sent into vLLM's worker process (collective_rpc with a function: the engine must run with
VLLM_ALLOW_INSECURE_SERIALIZATION=1, as these tests start it). Import-light: the worker imports this."""

from __future__ import annotations


def damage_after_copy(worker, name: str, times: int = 1) -> None:
    """Damage the worker's own storage of tensor `name` right after it copied it, `times` copies (-1: every
    one; 0: none any more). The sender and the read-back are untouched."""
    import types

    worker = getattr(worker, "worker", worker)     # a function gets vLLM's WorkerWrapperBase; ours is its .worker
    real = type(worker).hybridrl_copy
    left = [float("inf") if times < 0 else times]

    def faulty(self, items):
        real(self, items)
        if left[0] > 0 and any(n == name for n, _ in items):
            self.hybridrl_storage(name).view(-1)[0] += 1.0
            left[0] -= 1

    worker.hybridrl_copy = types.MethodType(faulty, worker)
