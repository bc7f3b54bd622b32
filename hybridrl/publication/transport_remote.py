"""Publication to separate rollout ranks (the disaggregated placement), over a process group.

The publish group holds training rank 0 (the sender: every training rank writes the buckets,
rank 0 holds them whole) and every rollout rank. Per delivery:

    sender     a header (the bucket's entries: name, shape, dtype, byte offsets; the names to
               apply; the sender's digests) as a broadcast object, then the flat buffer itself in
               one broadcast
    receivers  views into the received buffer -> their engine's `update_weights(..., digests)`
               (a buffer on the GPU goes whole to an engine's `load_bucket` when its row says it takes one:
               `delivery`), which copies into the engine's storage and reads it back (post_copy); then one
               all-reduce (MAX) of [mismatch flag per name, error flag, -policy version]
    sender     raises `WeightMismatch` for the names any receiver read back differently (the
               publisher copies them once more), `PublicationError` if a receiver could not apply
               the bucket; the lowest version the receivers now serve becomes `RemoteTarget`'s

After the publication (or its refusal) the sender's `finish()` sends an end header; the receivers
return from `receive_publication`. The version of a rollout engine therefore switches only when
every tensor arrived verified on it, as with an engine in the trainer's own process.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hybridrl.distributed.peers import Peers
from hybridrl.publication.buckets import BucketPlan, Entry, FlatBucket
from hybridrl.publication.manifest import PublicationError
from hybridrl.rollout.weight_spec import WeightMismatch

log = logging.getLogger(__name__)


class RemoteTarget:
    """What training rank 0 knows of the rollout ranks' engines (what `publish` reads of a target): the
    weight spec they serve (sent once at start) and the lowest policy version they confirmed."""

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], torch.dtype]], policy_version: int = 0):
        self._spec = dict(spec)
        self.policy_version = policy_version

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._spec)


class BroadcastTransport:
    def __init__(self, peers: Peers, engine: RemoteTarget, device: torch.device):
        self.peers, self.engine, self.device = peers, engine, device

    async def send(self, bucket: FlatBucket, version: int, *, names: Sequence[str] | None = None,
                   digests: Mapping[str, str] | None = None) -> None:
        names = list(names) if names is not None else [e.name for e in bucket.plan.entries]
        header = {"kind": "bucket", "version": version, "nbytes": bucket.plan.nbytes, "names": names,
                  "entries": [(e.name, e.shape, e.dtype, e.start, e.end) for e in bucket.plan.entries],
                  "digests": dict(digests) if digests is not None else None}
        me = self.peers.me
        self.peers.broadcast_object(header, me, device=self._object_device)
        self.peers.broadcast(bucket.buffer, me)
        answer = torch.zeros(len(names) + 2, dtype=torch.float64, device=self._object_device)
        answer[-1] = -float("inf")
        self.peers.all_reduce(answer, op=dist.ReduceOp.MAX)
        answer = answer.cpu()
        self.engine.policy_version = int(-answer[-1].item())
        if answer[-2] > 0:
            raise PublicationError(f"publication v{version}: a rollout rank could not apply a bucket of "
                                   f"{len(names)} tensor(s) (its own error names why); its engine did not switch")
        mismatched = [n for n, flag in zip(names, answer[:-2].tolist()) if flag > 0]
        if mismatched:
            raise WeightMismatch(mismatched, f"{len(mismatched)} tensor(s) read back differently on a rollout rank")

    def finish(self, version: int) -> None:
        """The end of a publication (sent after it, refused or not): the receivers return."""
        self.peers.broadcast_object({"kind": "end", "version": version}, self.peers.me, device=self._object_device)

    @property
    def _object_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def receive_publication(peers: Peers, engine: Any, run: Callable[[Any], Any], *, src: int,
                        device: torch.device, takes_buckets: bool = False,
                        served: Callable[[], int] | None = None) -> dict[str, Any]:
    """A rollout rank's side of one publication: apply every bucket the sender broadcasts to `engine`
    (`run` awaits an engine coroutine wherever the engine's loop is) until the end header. `takes_buckets`:
    the engine's row says it loads flat buckets (`RolloutEngineSpec.loads_flat_buckets`). Returns
    {'buckets', 'bytes', 'retried', 'error'}; `error` is the first exception applying a bucket (the
    sender was told; the caller raises it). `served()`: the version to confirm to the sender (default the
    engine's; an engine that stages an update in flight confirms the version it holds verified)."""
    served = served or (lambda: engine.policy_version)
    object_device = device if device.type == "cuda" else torch.device("cpu")
    buffer: torch.Tensor | None = None
    out: dict[str, Any] = {"buckets": 0, "bytes": 0, "retried": 0, "error": None}
    while True:
        header = peers.broadcast_object(None, src, device=object_device)
        if header["kind"] == "end":
            return out
        nbytes = header["nbytes"]
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        flat = buffer[:nbytes]
        peers.broadcast(flat, src)
        names = header["names"]
        answer = torch.zeros(len(names) + 2, dtype=torch.float64)
        if out["error"] is None:
            try:
                run(delivery(engine, flat, header, takes_buckets=takes_buckets))
            except WeightMismatch as err:
                bad = set(err.names)
                for i, n in enumerate(names):
                    answer[i] = float(n in bad)
            except Exception as err:  # noqa: BLE001 - told to the sender, raised by the caller afterwards
                log.error("applying a published bucket failed: %s", err)
                out["error"] = err
        if out["error"] is not None:
            answer[-2] = 1.0
        answer[-1] = -float(served())
        answer = answer.to(object_device)
        peers.all_reduce(answer, op=dist.ReduceOp.MAX)
        out["buckets"] += 1
        out["bytes"] += nbytes
        out["retried"] += int(len(names) < len(header["entries"]))


def delivery(engine: Any, flat: torch.Tensor, header: Mapping[str, Any], *, takes_buckets: bool = False) -> Any:
    """The engine coroutine that applies one received bucket. A buffer on the GPU goes whole to an engine
    that takes flat buckets (`takes_buckets`: its `load_bucket`; vLLM hands it to its worker as one CUDA IPC
    handle, where `update_weights` would have to read each tensor's bytes on the host); otherwise its views
    go to `update_weights`."""
    names, digests = header["names"], header["digests"]
    digests = {n: digests[n] for n in names} if digests is not None else None
    if flat.device.type != "cpu" and takes_buckets:
        plan = BucketPlan(entries=[Entry(name, tuple(shape), dtype, start, end)
                                   for name, shape, dtype, start, end in header["entries"]])
        return engine.load_bucket(FlatBucket(plan, flat), header["version"], names=names, digests=digests)
    views = {name: flat[start:end].view(dtype).view(shape) for name, shape, dtype, start, end in header["entries"]}
    return engine.update_weights([(n, views[n]) for n in names], header["version"], digests=digests)
