"""`StagedWeights`: a policy version received beside the live weights (`on_weight_update=continue`).

With `continue` the engine never stops for a publication: each bucket is copied into a staging
tensor of its own and read back from there against the sender's digest (what arrives verified
counts, as with a copy into the live weights), while the engine keeps stepping on the version it
serves. Once every tensor of the weight spec is staged, the version is *ready*; the engine copies
it into its live weights in one go between two steps (`EngineCore.apply_staged`), so no token is
ever sampled from a partly updated model. Costs one copy of the published tensors while a version
is in flight.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hybridrl.publication.digest import tensor_digests
from hybridrl.rollout.versions import Publication
from hybridrl.rollout.weight_spec import WeightMismatch


class StagedWeights:
    def __init__(self, views: Mapping[str, torch.Tensor], version: int):
        self._views = views
        self._arrivals = Publication(views, version)      # what has arrived verified, per version
        self._tensors: dict[str, torch.Tensor] = {}
        self._digests: dict[str, str] = {}
        self.ready: int | None = None                      # a version staged whole, not yet applied

    def stage(self, items: Sequence[tuple[str, torch.Tensor]], version: int,
              digests: Mapping[str, str] | None) -> bool:
        """Copy validated tensors into staging (read back against `digests` when given); True once `version`
        is staged whole. A newer version supersedes an incomplete one; a ready one must be applied first."""
        if self.ready is not None:
            raise RuntimeError(f"update_weights v{version}: version {self.ready} is staged whole and not yet applied")
        self._arrivals.check(version)
        if self._arrivals.pending != version:
            self._tensors, self._digests = {}, {}
        copies = {name: self._views[name].new_empty(t.shape).copy_(t) for name, t in items}
        bad: list[str] = []
        if digests is not None:
            held = tensor_digests(list(copies.items()))
            bad = [name for name in copies if held[name] != digests.get(name)]
            self._digests.update({name: digests[name] for name in copies if name not in bad})
        good = [name for name in copies if name not in bad]
        self._tensors.update({name: copies[name] for name in good})
        if self._arrivals.arrive(good, version):
            self.ready = version
        if bad:
            raise WeightMismatch(bad, f"update_weights v{version}: {len(bad)} tensor(s) read back from the engine's "
                                      f"staging storage differ from the sender's digest: {bad[:5]}")
        return self.ready is not None

    def take(self) -> tuple[list[tuple[str, torch.Tensor]], int, dict[str, str] | None]:
        """The ready version's tensors (in weight-spec order), its number and digests; staging is then empty."""
        assert self.ready is not None
        version, self.ready = self.ready, None
        items = [(name, self._tensors[name]) for name in self._views]
        digests = dict(self._digests) if len(self._digests) == len(items) else None
        self._tensors, self._digests = {}, {}
        return items, version, digests

    @property
    def busy(self) -> bool:
        """Some version is partly or wholly staged."""
        return self.ready is not None or self._arrivals.pending is not None

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())
