from __future__ import annotations

import pytest
import torch

from hybridrl.data.batch import Batch, BatchShapeError, pad_sequences


def make(n=5, t=3):
    return Batch({"ids": torch.arange(n * t).view(n, t), "loss_mask": torch.ones(n, t)},
                 {"uid": [f"u{i}" for i in range(n)]})


def test_shape_checks_fail_clearly():
    with pytest.raises(BatchShapeError, match=r"tensor 'a': 3.*tensor 'b': 4"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(BatchShapeError, match="meta 'm': 2"):
        Batch({"a": torch.zeros(3)}, {"m": [1, 2]})
    with pytest.raises(BatchShapeError, match="0-d"):
        Batch({"a": torch.tensor(1.0)})
    b = make()
    with pytest.raises(BatchShapeError):
        b.set("bad", torch.zeros(4))
    assert "bad" not in b            # a failed set leaves the batch as it was
    with pytest.raises(KeyError, match="batch has no 'nope'"):
        b["nope"]


def test_select_repeat_slice():
    b = make()
    s = b.select([4, 0, 0])
    assert s["uid"] == ["u4", "u0", "u0"] and torch.equal(s["ids"][0], b["ids"][4])
    r = b.slice(0, 2).repeat_interleave(3)
    assert r["uid"] == ["u0"] * 3 + ["u1"] * 3
    with pytest.raises(IndexError):
        b.select([5])


def test_pad_chunk_concat_strip_roundtrip():
    b = make(5)
    p = b.pad_to_multiple(4, zero=["loss_mask"])
    assert len(p) == 8 and p.num_padding == 3 and p.num_valid == 5
    assert torch.equal(p["ids"][5], b["ids"][0])          # padding copies real rows (no degenerate rows)
    assert p["loss_mask"][5:].sum() == 0 and p["loss_mask"][:5].sum() == 15
    assert p["uid"][5:] == [None] * 3
    assert p.valid_rows.tolist() == [True] * 5 + [False] * 3
    chunks = p.chunk(4)
    assert [c.num_padding for c in chunks] == [0, 0, 1, 2]
    assert [len(c) for c in chunks] == [2, 2, 2, 2]
    back = Batch.concat([c.strip_padding() for c in chunks])
    assert back["uid"] == b["uid"] and torch.equal(back["ids"], b["ids"])
    with pytest.raises(BatchShapeError, match="pad it first"):
        b.chunk(2)
    with pytest.raises(BatchShapeError, match="padding mid-batch"):
        Batch.concat(chunks)


def test_concat_checks():
    a = make(2, 3)
    with pytest.raises(BatchShapeError, match="trailing dims"):
        Batch.concat([a, make(2, 4)])
    with pytest.raises(BatchShapeError, match="holds"):
        Batch.concat([a, Batch({"ids": torch.zeros(1, 3, dtype=torch.long)})])


def test_split_micro_batches_and_pad_sequences():
    b = make(5)
    assert [len(m) for m in b.split(2)] == [2, 2, 1]
    x = pad_sequences([[1, 2, 3], [4]], pad_value=-1)
    assert x.tolist() == [[1, 2, 3], [4, -1, -1]]
    assert pad_sequences([[1, 2, 3], [4]], pad_value=-1, left=True).tolist() == [[1, 2, 3], [-1, -1, 4]]
    with pytest.raises(BatchShapeError):
        pad_sequences([[1, 2, 3]], length=2)


def test_concat_pads_sequence_dim_when_asked():
    a = Batch({"ids": torch.ones(1, 2, dtype=torch.long), "m": torch.ones(1, 2)})
    b = Batch({"ids": torch.ones(2, 4, dtype=torch.long), "m": torch.ones(2, 4)})
    with pytest.raises(BatchShapeError):
        Batch.concat([a, b])
    c = Batch.concat([a, b], pad_dim1={"ids": 7, "m": 0.0})
    assert c["ids"].tolist()[0] == [1, 1, 7, 7] and c["m"][0].tolist() == [1, 1, 0, 0] and len(c) == 3


def test_concat_fills_a_padded_tensor_that_one_shard_lacks():
    """A rollout shard of placeholder rows has no routing record: concat gives it one of the pad value."""
    routed = torch.arange(2 * 3 * 2 * 2, dtype=torch.int8).reshape(2, 3, 2, 2)
    real = Batch({"ids": torch.ones(2, 3, dtype=torch.long), "routed_experts": routed})
    placeholder = Batch({"ids": torch.zeros(1, 1, dtype=torch.long)}, num_padding=1)
    c = Batch.concat([real, placeholder], pad_dim1={"ids": 0, "routed_experts": -1})
    assert c["routed_experts"].shape == (3, 3, 2, 2) and c["routed_experts"].dtype == torch.int8
    assert torch.equal(c["routed_experts"][:2], routed) and bool((c["routed_experts"][2] == -1).all())
    assert c.num_padding == 1
