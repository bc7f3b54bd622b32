"""algo.partial_policy on hand-built multi-version rows: which tokens the loss sees."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algo import correction, partial
from hybridrl.config.fields import ConfigValueError
from hybridrl.algo.config import AlgoConfig
from hybridrl.data.batch import Batch

# row 0: prompt (2 tokens), v3 x2, observation, v4 x2   -> mixed
# row 1: prompt (2 tokens), v4 x3, padding x2            -> one version
MASK = torch.tensor([[0, 0, 1, 1, 0, 1, 1],
                     [0, 0, 1, 1, 1, 0, 0]], dtype=torch.float32)
VERSIONS = torch.tensor([[-1, -1, 3, 3, -1, 4, 4],
                         [-1, -1, 4, 4, 4, -1, -1]])


def _batch() -> Batch:
    return Batch({"loss_mask": MASK.clone(), "policy_version": VERSIONS.clone()})


def test_newest_segment_trains_only_the_newest_version_and_keeps_the_rest_as_context():
    b = _batch()
    counts = partial.apply("newest_segment", b)
    assert b["loss_mask"].tolist() == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 0, 0]]
    assert counts == {"partial/mixed_rows": 1.0, "partial/context_tokens": 2.0}
    assert b["policy_version"].tolist() == VERSIONS.tolist()          # never relabelled


def test_discard_mixed_drops_every_token_of_a_mixed_row():
    b = _batch()
    counts = partial.apply("discard_mixed", b)
    assert b["loss_mask"].tolist() == [[0] * 7, [0, 0, 1, 1, 1, 0, 0]]
    assert counts == {"partial/mixed_rows": 1.0, "partial/context_tokens": 4.0}


def test_per_segment_keeps_all_tokens_each_weighted_by_its_own_behaviour_logprob():
    b = _batch()
    partial.apply("per_segment", b)
    assert b["loss_mask"].tolist() == MASK.tolist()
    # the correction is per token: the v3 tokens' weights use the v3 behaviour logprobs
    old = torch.tensor([[0, 0, -1.0, -1.0, 0, -2.0, -2.0]])
    behaviour = torch.tensor([[0, 0, -1.5, -0.5, 0, -2.0, -3.0]])
    w = correction.tis_weights(old, behaviour, cap=2.0)
    expected = [1.0, 1.0, min(2.0, float(torch.exp(torch.tensor(0.5)))), float(torch.exp(torch.tensor(-0.5))),
                1.0, 1.0, 2.0]
    assert w[0].tolist() == pytest.approx(expected)


def test_unknown_policy_and_per_segment_without_correction_are_refused():
    with pytest.raises(ValueError, match="partial_policy"):
        partial.apply("newest", _batch())
    with pytest.raises(ConfigValueError, match="tis_cap"):
        AlgoConfig(partial_policy="per_segment", tis_cap=0.0)
