"""Publishing a policy into a rollout engine: manifest, verification, bucketed transfer, switch.

    structure check (names, shapes, dtypes vs engine.weight_spec(), before anything moves)
    two_pass:  pass 1 streams every bucket through the transport's verification (the sender's
               and the receiver's digest of every tensor must agree); nothing is copied
    copy pass: buckets go through the transport into the engine's own storage; the engine
               switches to the new version once every tensor has arrived
    manifest:  PolicyRelease with the checkpoint hash (xxh3-128 over the per-tensor digests in
               canonical name order), model / tokenizer / chat-template hashes; ready=True

A refused publication raises `PublicationRefused` before the copy pass: the engine keeps serving
the version it had. (In `structure` mode a content fault is not detected; the parity probe is the
remaining check.)
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import xxhash

from hybridrl.publication.buckets import bucketize, nbytes
from hybridrl.publication.config import PublishConfig
from hybridrl.publication.manifest import (
    HASH_ALGO,
    PolicyRelease,
    PublicationError,
    PublicationRefused,
    check_specs,
    tensor_digest,
)

Groups = Callable[[], Iterable[Sequence[tuple[str, torch.Tensor]]]]


@dataclass
class PublishStats:
    verify_s: float = 0.0
    copy_s: float = 0.0
    bytes_copied: int = 0
    num_buckets: int = 0


def checkpoint_hash(digests: dict[str, str]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return f"{HASH_ALGO}:{h.hexdigest()}"


def _digests(bucket: Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
    return {name: tensor_digest(name, t) for name, t in bucket}


async def publish(groups: Groups, *, spec: dict, engine, transport, cfg: PublishConfig, version: int, step: int,
                  hashes: dict[str, str]) -> tuple[PolicyRelease, PublishStats]:
    """`groups()` yields the model's fused groups of (HF name, full tensor); it is called once per pass."""
    published = {name: (tuple(shape), str(dtype).replace("torch.", "")) for name, (shape, dtype) in spec.items()}
    problems = check_specs(published.items(), engine.weight_spec())
    if problems:
        raise PublicationRefused(f"publication v{version} refused before any copy: " + "; ".join(problems))
    stats = PublishStats()
    bucket_bytes = cfg.bucket_mb * 2**20
    digests: dict[str, str] = {}

    # digests run on a helper thread (xxhash and torch's copy both release the GIL): in two_pass the
    # sender's side while the transport hashes the receiver's, in structure mode the manifest's
    # while the bucket is copied (at most two buckets wait for hashing)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-hash") as hasher:
        if cfg.verify == "two_pass":
            started = time.perf_counter()
            for bucket in bucketize(groups(), bucket_bytes):
                sending = hasher.submit(_digests, bucket)
                received = await transport.digests(bucket)
                sent = sending.result()
                bad = sorted(n for n in sent if received.get(n) != sent[n])
                if bad:
                    raise PublicationRefused(f"publication v{version} refused: {len(bad)} tensor(s) arrived "
                                             f"corrupted ({bad[:5]}); the engine keeps serving "
                                             f"v{engine.policy_version}")
                digests.update(sent)
            stats.verify_s = time.perf_counter() - started

        started = time.perf_counter()
        hashing: deque[Future] = deque()
        for bucket in bucketize(groups(), bucket_bytes):
            if cfg.verify == "structure":
                hashing.append(hasher.submit(_digests, bucket))
            await transport.send(bucket, version)
            stats.bytes_copied += sum(nbytes(t) for _, t in bucket)
            stats.num_buckets += 1
            while len(hashing) > 2 or (hashing and hashing[0].done()):
                digests.update(hashing.popleft().result())
        while hashing:
            digests.update(hashing.popleft().result())
        stats.copy_s = time.perf_counter() - started
    if set(digests) != set(spec):
        raise PublicationError(f"publication v{version}: the model yielded {len(digests)} tensors, "
                               f"the manifest lists {len(spec)}")
    if engine.policy_version != version:
        raise PublicationError(f"engine did not switch to v{version} after every tensor arrived "
                               f"(it reports v{engine.policy_version})")
    release = PolicyRelease(policy_version=version, training_step=step, checkpoint_hash=checkpoint_hash(digests),
                            tensor_hashes=digests, tensor_specs=published, ready=True, **hashes)
    return release, stats
