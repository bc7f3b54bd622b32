"""Run under torchrun (2 ranks, gloo): one rollout group of two ranks publishing, where one rank's
check refuses and the other's accepts (tests/publication/test_agree.py).

Rank 0 plays the engine's owner and rank 1 the stand-in (`FollowerEngine`), as in a rollout
tensor-parallel group; the transport gathers each bucket's payload to rank 0 and ends with a
barrier over the group, as the CUDA IPC transport does. A refusal comes from a dtype: the owner's
engine holds the checkpoint in bfloat16 while the trainer publishes float32 (or the reverse). Rank
0 writes what each case gave to OUT.json. Usage: python -m tests.publication.agree_jobs OUT.json"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridrl.distributed.peers import Peers
from hybridrl.publication.buckets import Staging
from hybridrl.publication.config import PublishConfig
from hybridrl.publication.manifest import PublicationRefused
from hybridrl.publication.publish import TensorGroups, publish
from hybridrl.rollout.follower import FollowerEngine

HASHES = {"model_config_hash": "m", "tokenizer_hash": "t", "chat_template_hash": "c"}
TENSORS = [[("a.weight", torch.ones(4, 3)), ("b.weight", torch.zeros(5))], [("c.weight", torch.full((2, 2), 3.0))]]


class GatherTransport:
    """The CUDA IPC transport's collectives on CPU: each rank's payload gathered to the owner (rank 0),
    the engine loads it, a barrier keeps the buffers alive."""

    def __init__(self, engine, group):
        self.engine, self.group, self.gathered = engine, group, 0

    async def send(self, bucket, version, *, names=None, digests=None):
        rank = dist.get_rank()
        box = [None, None] if rank == 0 else None
        dist.gather_object(bucket.plan.nbytes, box, dst=0, group=self.group)
        self.gathered += 1
        await self.engine.load_serialized(box, list(bucket.views), version)
        dist.barrier(group=self.group)


def engine(dtype: torch.dtype) -> FollowerEngine:
    spec = {n: (tuple(t.shape), dtype) for g in TENSORS for n, t in g}
    return FollowerEngine(spec, eos_token_ids=(), vocab_size=8, max_model_len=0)


def attempt(eng, group, version: int, peers) -> dict:
    transport = GatherTransport(eng, group)
    try:
        asyncio.run(publish(TensorGroups(TENSORS), engine=eng, transport=transport,
                            cfg=PublishConfig(verify="structure", bucket_mb=1), version=version, step=version,
                            hashes=HASHES, staging=Staging("cpu"), peers=peers))
        outcome = "published"
    except PublicationRefused as err:
        outcome = f"refused: {err}"
    except RuntimeError as err:                       # a collective that timed out
        outcome = f"error: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return {"outcome": outcome, "version": eng.policy_version, "gathered": transport.gathered}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    peers = Peers(dist.group.WORLD, [0, 1], rank)
    bf16_on = {"owner refuses": 0, "stand-in refuses": 1, "both accept": None}
    results: dict = {}
    for version, (case, refuser) in enumerate(bf16_on.items(), start=1):
        eng = engine(torch.bfloat16 if rank == refuser else torch.float32)
        results[case] = attempt(eng, group, version, peers)
        dist.barrier()
    # the same refusal decided by each rank alone: rank 1 enters the gather that rank 0 skipped
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
    results["decided alone"] = attempt(engine(torch.bfloat16 if rank == 0 else torch.float32), short, 9, None)
    everyone = [None, None]
    dist.all_gather_object(everyone, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    # the short group's pair broke at rank 1's timeout: left to interpreter exit, gloo's threads are
    # torn down in no fixed order and may abort the process ("terminate called without an active
    # exception") after the results are written; an explicit teardown on every rank has none of that
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hybridrl.distributed.process_exit import run_then_leave

    run_then_leave(lambda: main(sys.argv[1]))
