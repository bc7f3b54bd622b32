"""Digests, the checkpoint hash, flat bucket plans and the structure check (no engine, no ranks)."""

from __future__ import annotations

import pytest
import torch

from hybridrl.publication.buckets import FlatBucket, Staging, plan_buckets
from hybridrl.publication.digest import checkpoint_hash, tensor_digest
from hybridrl.publication.manifest import PolicyRelease, PublicationError, model_hashes

F32, BF16 = torch.float32, torch.bfloat16


def test_buckets_never_split_a_group_respect_size_and_align_views():
    groups = [[("a.q", (10,), F32), ("a.k", (10,), F32), ("a.v", (10,), F32)],     # 120 B
              [("b", (5,), BF16)],                                                # 10 B
              [("c", (100,), F32)],                                               # 400 B > bucket
              [("d.gate", (10,), F32), ("d.up", (10,), F32)]]                     # 80 B
    plans = plan_buckets(groups, bucket_bytes=160)
    assert [[e.name for e in p.entries] for p in plans] == [["a.q", "a.k", "a.v", "b"], ["c"], ["d.gate", "d.up"]]
    assert [p.groups for p in plans] == [[0, 1], [2], [3]]
    bucket = Staging("cpu").bucket(plans[0], 0)
    assert bucket.buffer.numel() == plans[0].nbytes == 130
    for name, t in bucket.named():                       # every view lies inside the one buffer
        assert t.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
    bucket.views["b"].copy_(torch.arange(5, dtype=BF16))
    assert bucket.views["b"].tolist() == [0, 1, 2, 3, 4]
    # an element size the running offset does not divide: the entry starts at the next multiple
    odd = plan_buckets([[("x", (1,), BF16)], [("y", (2,), F32)]], 1 << 20)[0]
    assert [(e.start, e.end) for e in odd.entries] == [(0, 2), (4, 12)]
    with pytest.raises(ValueError):
        plan_buckets(groups, 0)
    with pytest.raises(ValueError, match="buffer"):
        FlatBucket(plans[0], torch.empty(10, dtype=torch.uint8))


def test_digest_detects_any_change_and_the_checkpoint_hash_ignores_order():
    t = torch.arange(6, dtype=F32).view(2, 3)
    base = tensor_digest("w", t)
    assert tensor_digest("w", t.clone()) == base
    assert tensor_digest("w2", t) != base                     # the name is hashed
    assert tensor_digest("w", t.view(3, 2)) != base           # the shape is hashed
    assert tensor_digest("w", t.double()) != base             # the dtype is hashed
    flipped = t.clone()
    flipped[1, 2] = torch.nextafter(flipped[1, 2], torch.tensor(100.0))
    assert tensor_digest("w", flipped) != base                # one ulp changes it
    assert checkpoint_hash({"a": "1", "b": "2"}) == checkpoint_hash({"b": "2", "a": "1"})
    assert checkpoint_hash({"a": "1", "b": "2"}) != checkpoint_hash({"a": "2", "b": "1"})
    assert checkpoint_hash({"a": "1"}).startswith("xxh3_128:")


def test_structure_check_names_the_problems(tiny_models):
    spec = {"w": ((2, 3), F32), "b": ((3,), F32)}
    rel = PolicyRelease(policy_version=2, training_step=1, checkpoint_hash="x", **model_hashes(tiny_models("qwen2")),
                        tensor_specs={"w": ((2, 3), "float32"), "b": ((4,), "float32"), "z": ((1,), "float32")})
    with pytest.raises(PublicationError) as info:
        rel.check_structure(spec)
    msg = str(info.value)
    assert "unknown tensor(s): ['z']" in msg and "tensor 'b' has shape (4,), expected (3,)" in msg
    rel.tensor_specs = {"w": ((2, 3), "float32")}
    with pytest.raises(PublicationError, match=r"missing tensor\(s\): \['b'\]"):
        rel.check_structure(spec)
    rel.tensor_specs = {"w": ((2, 3), "float32"), "b": ((3,), "float32")}
    rel.check_structure(spec)
    assert set(rel.summary()) == {"policy_version", "training_step", "checkpoint_hash", "model_config_hash",
                                  "tokenizer_hash", "chat_template_hash", "sampler_contract", "created_at", "ready"}


def test_device_checksum_catches_changes_without_a_host_copy_of_the_bytes():
    g = torch.Generator().manual_seed(0)
    for dtype, n in ((F32, 1000), (BF16, 1001), (F32, 1)):
        t = torch.randn(n, generator=g).to(dtype)
        base = tensor_digest("w", t, on_device=True)
        assert base != tensor_digest("w", t)                            # the digest says how it was made
        assert tensor_digest("w", t.clone(), on_device=True) == base
        for i in {0, n // 2, n - 1}:                                    # one element, first/middle/last (tail)
            changed = t.clone()
            changed.view(torch.int16 if dtype == BF16 else torch.int32)[i] += 1
            assert tensor_digest("w", changed, on_device=True) != base, (dtype, n, i)
        if n > 2:
            swapped = t.clone()
            swapped[[0, 1]] = t[[1, 0]]
            assert (t[0] == t[1]) or tensor_digest("w", swapped, on_device=True) != base
    # a view that does not start on an 8-byte boundary, and a multi-chunk tensor
    big = torch.randn((1 << 23) + 3, generator=g)                     # two chunks of words
    view = big[1:]
    assert tensor_digest("v", view, on_device=True) == tensor_digest("v", view.clone(), on_device=True)
    flipped = view.clone()
    flipped[-5] = flipped[-5] + 1
    assert tensor_digest("v", flipped, on_device=True) != tensor_digest("v", view, on_device=True)


def test_digests_of_a_bucket_equal_each_tensors_digest():
    """Batched (one host transfer for a device's checksums) and one by one agree, both ways of hashing."""
    from hybridrl.publication.digest import tensor_digests

    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(5, 3, generator=g)), ("b", torch.randn(7, generator=g).to(BF16)), ("c", torch.ones(1))]
    for on_device in (True, False):
        assert tensor_digests(named, on_device=on_device) == {n: tensor_digest(n, t, on_device=on_device)
                                                              for n, t in named}
    assert tensor_digests(named)["a"] == tensor_digest("a", named[0][1])


def test_hashing_reads_the_bytes_in_place_and_leaves_the_storage_resizable():
    """The digest reads the tensor's own bytes (the same digest as a copy's), without exporting its buffer: an
    export would fix the storage's size, and the native engine frees its weights by resizing theirs."""
    t = torch.arange(1000, dtype=torch.float32)
    view = t[10:500]
    assert tensor_digest("w", view) == tensor_digest("w", view.clone())
    assert tensor_digest("w", view) != tensor_digest("w", t[11:501].clone())
    assert t.untyped_storage().resizable()
    t.untyped_storage().resize_(0)
