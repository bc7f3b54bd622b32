from __future__ import annotations

import pytest

from hybridrl.distributed.mesh import Mesh


def test_megatron_rank_order_and_output_ranks():
    # pp=2, dp=2, tp=2: tp fastest, then dp, then pp (Megatron's default order)
    m = Mesh("train", ("pp", "dp", "tp"), (2, 2, 2))
    assert m.coords(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert m.coords(1) == {"pp": 0, "dp": 0, "tp": 1}
    assert m.coords(2) == {"pp": 0, "dp": 1, "tp": 0}
    assert m.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert all(m.rank_of(**m.coords(r)) == r for r in range(8))
    assert m.output_ranks() == [4, 6]           # tp 0 of the last pp stage, in dp order
    assert m.group_along("tp", 6) == [6, 7]
    assert m.groups_along("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.dp_size == 2 and m.world_size == 8


def test_flat_and_errors():
    m = Mesh.flat("world", 3)
    assert m.output_ranks() == [0, 1, 2] and m.dp_rank(2) == 2
    with pytest.raises(ValueError):
        m.coords(3)
    with pytest.raises(ValueError, match="dp axis"):
        Mesh("x", ("tp",), (2,))
