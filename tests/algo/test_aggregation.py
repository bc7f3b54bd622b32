from __future__ import annotations

import pytest
import torch

from hybridrl.algo.aggregation import AGGREGATIONS, Denominators, aggregate, count


def test_hand_computed_values():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 1], [0, 0, 0]])    # row 2 is padding
    d = count(m)
    assert d == Denominators(3.0, 2.0)
    assert aggregate(v, m, "token-mean", d).item() == pytest.approx((1 + 2 + 6) / 3)
    assert aggregate(v, m, "seq-mean-token-sum", d).item() == pytest.approx((3 + 6) / 2)
    assert aggregate(v, m, "seq-mean-token-mean", d).item() == pytest.approx((1.5 + 6) / 2)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_with_global_denominators_sum_to_the_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(6, 5, generator=g)
    m = (torch.rand(6, 5, generator=g) > 0.4).long()
    m[3] = 0
    full = aggregate(v, m, mode, count(m))
    d = count(m)   # global: counted once over everything
    parts = sum(aggregate(v[i:i + 2], m[i:i + 2], mode, d) for i in range(0, 6, 2))
    assert torch.allclose(parts, full)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(v, m, "mean", d)
