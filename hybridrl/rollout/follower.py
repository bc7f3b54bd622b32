"""`FollowerEngine`: what a rank that does not own its rollout group's engine holds.

With rollout tensor parallelism R > 1, one engine serves each group of R ranks and lives on the
group's first rank (SGLang runs its own TP workers on the group's GPUs). The other ranks still
take part in every collective of a publication (gathers of the trainer's shards), so they run
the same publication code against this stand-in: it checks names, shapes and dtypes and tracks
the policy version with the same tracker as the owner's engine, releases and resumes the same
memory tags (releasing "weights" forgets the version, as the owner's engine does), and holds no
weights and no KV cache. It cannot read back weights it does not hold: the owner verifies.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import torch

from hybridrl.rollout.protocol import KV_CACHE, WEIGHTS, GenerationOutput, SamplingParams, check_tags
from hybridrl.rollout.versions import Publication
from hybridrl.rollout.weight_spec import validate_named_tensors


class FollowerEngine:
    def __init__(self, spec: dict[str, tuple[tuple[int, ...], torch.dtype]], *, eos_token_ids: Sequence[int] = (),
                 vocab_size: int | None = None, max_model_len: int = 0, releasable_tags: Iterable[str] = (KV_CACHE,),
                 policy_version: int = 0):
        self._spec = dict(spec)
        self._publication = Publication(self._spec, policy_version)
        self.releasable_tags = frozenset(releasable_tags)
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    @property
    def policy_version(self) -> int:
        return self._publication.version

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._spec)

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> GenerationOutput:
        raise RuntimeError("this rank does not own its rollout group's engine; generation runs on the group's "
                           "first rank")

    async def abort(self, request_id: str) -> bool:
        return False

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             digests: Mapping[str, str] | None = None) -> None:
        items = list(named_tensors)
        validate_named_tensors(items, self._spec)
        self._publication.arrive([name for name, _ in items], version)

    async def load_serialized(self, payloads: Any, names: list[str], version: int, *,
                              load_format: str | None = None) -> None:
        """The CUDA IPC transport's call on a follower: the owner loaded the bucket; track it."""
        unknown = sorted(set(names) - set(self._spec))
        if unknown:
            raise ValueError(f"update_weights: {len(unknown)} unknown tensor(s): {unknown[:5]}")
        self._publication.arrive(names, version)

    async def sleep(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        if WEIGHTS in check_tags(self, tags):
            self._publication.forget()

    async def wake_up(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        check_tags(self, tags)

    def writable_views(self, names: Sequence[str]) -> None:
        """A stand-in holds no storage to write into: a publication to it goes through buckets."""
        return None

    def stats(self) -> dict[str, Any]:
        return {"policy_version": self.policy_version, "follower": True}

    def close(self) -> None:
        return None
