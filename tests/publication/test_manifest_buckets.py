from __future__ import annotations

import pytest
import torch

from hybridrl.publication.buckets import bucketize, nbytes
from hybridrl.publication.manifest import PolicyRelease, PublicationError, StreamHasher, model_hashes, tensor_digest


def test_buckets_never_split_a_group_and_respect_size():
    groups = [[("a.q", torch.zeros(10)), ("a.k", torch.zeros(10)), ("a.v", torch.zeros(10))],   # 120 B
              [("b", torch.zeros(5))],                                                            # 20 B
              [("c", torch.zeros(100))],                                                          # 400 B > bucket
              [("d.gate", torch.zeros(10)), ("d.up", torch.zeros(10))]]                           # 80 B
    buckets = list(bucketize(groups, bucket_bytes=160))
    names = [[n for n, _ in b] for b in buckets]
    assert names == [["a.q", "a.k", "a.v", "b"], ["c"], ["d.gate", "d.up"]]
    assert all(sum(nbytes(t) for _, t in b) <= 160 or len(b) == 1 for b in buckets)
    with pytest.raises(ValueError):
        list(bucketize(groups, 0))


def test_hash_detects_any_change_and_order():
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    base = tensor_digest("w", t)
    assert tensor_digest("w", t.clone()) == base
    assert tensor_digest("w2", t) != base                     # the name is hashed
    assert tensor_digest("w", t.view(3, 2)) != base           # the shape is hashed
    assert tensor_digest("w", t.double()) != base             # the dtype is hashed
    flipped = t.clone()
    flipped[1, 2] = torch.nextafter(flipped[1, 2], torch.tensor(100.0))
    assert tensor_digest("w", flipped) != base                # one ulp changes it
    h = StreamHasher()
    h.update("a", t)
    with pytest.raises(PublicationError, match="canonical order"):
        h.update("a", t)


def test_structure_check_names_the_problems(tiny_models):
    spec = {"w": ((2, 3), torch.float32), "b": ((3,), torch.float32)}
    rel = PolicyRelease(policy_version=2, training_step=1, checkpoint_hash="x", **model_hashes(tiny_models("qwen2")),
                        tensor_specs={"w": ((2, 3), "float32"), "b": ((4,), "float32"), "z": ((1,), "float32")})
    with pytest.raises(PublicationError) as info:
        rel.check_structure(spec)
    msg = str(info.value)
    assert "unexpected tensor(s): ['z']" in msg and "'b' is (4,) float32, the engine holds (3,) float32" in msg
    rel.tensor_specs = {"w": ((2, 3), "float32"), "b": ((3,), "float32")}
    rel.check_structure(spec)
    assert set(rel.summary()) == {"policy_version", "training_step", "checkpoint_hash", "model_config_hash",
                                  "tokenizer_hash", "chat_template_hash", "sampler_contract", "created_at", "ready"}


def test_device_checksum_catches_changes_without_a_host_copy_of_the_bytes():
    g = torch.Generator().manual_seed(0)
    for dtype, n in ((torch.float32, 1000), (torch.bfloat16, 1001), (torch.float32, 1)):
        t = torch.randn(n, generator=g).to(dtype)
        base = tensor_digest("w", t, on_device=True)
        assert base != tensor_digest("w", t)                            # the digest says how it was made
        assert tensor_digest("w", t.clone(), on_device=True) == base
        for i in {0, n // 2, n - 1}:                                    # one element, first/middle/last (tail)
            changed = t.clone()
            changed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[i] += 1
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
