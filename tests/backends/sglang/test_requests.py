"""The SGLang backend's requests built against the pinned release's own types (CPU).

Runs in a subprocess (the pinned types are imported with stand-ins for their GPU-only imports:
tests/backends/sglang/real_types.py) when `make sglang-types` has installed them; skipped with that
reason otherwise. What it checks is what broke on newer releases: the request types are msgspec
Structs (not dataclasses), weight updates need a session, payloads are bytes, and a flat bucket
travels in SGLang's own flattened-bucket format and comes back out as the same tensors.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.backends.sglang.real_types import ROOT
from tests.launch import env_with_repo

SCRIPT = textwrap.dedent('''
    import torch
    from tests.backends.sglang.real_types import load
    io, Metadata, version = load()
    import msgspec
    from hybridrl.backends.sglang import requests
    from hybridrl.publication.buckets import Staging, plan_buckets

    assert version.__version__ == requests.SGLANG_VERSION, version.__version__
    req = requests.update_from_tensor(io, [b"rank0", b"rank1"], 7, load_format=requests.FLATTENED_BUCKET)
    assert isinstance(req, msgspec.Struct) and type(req) is io.UpdateWeightsFromTensorReqInput
    assert (req.serialized_named_tensors, req.weight_version, req.flush_cache, req.load_format) == (
        [b"rank0", b"rank1"], "7", False, "flattened_bucket")
    try:
        requests.update_from_tensor(io, ["base64 text"], 7, load_format=None)
        raise AssertionError("a str payload was accepted")
    except TypeError:
        pass
    # every request round-trips through sglang's own wire encoding (what reaches the scheduler)
    for r in (req, requests.begin_update(io), requests.end_update(io), requests.release(io, ["weights", "kv_cache"]),
              requests.resume(io, ["cuda_graph"]), requests.pause(io), requests.resume_generation(io)):
        back = io._msgpack_decoder.decode(io._msgpack_encoder.encode(r)) if hasattr(io, "_msgpack_decoder") else r
        assert type(back) is type(r) and msgspec.structs.asdict(back) == msgspec.structs.asdict(r), r
    assert requests.release(io, ["kv_cache"]).tags == ["kv_cache"]
    assert type(requests.pause(io)) is io.PauseGenerationReqInput and requests.pause(io).mode == "retract"
    assert requests.result_ok((False, "outside a session")) == (False, "outside a session")
    assert requests.result_ok(io.EndWeightUpdateReqOutput(success=True, message="ok")) == (True, "ok")

    # a flat bucket in SGLang's flattened-bucket format, reconstructed by SGLang's own class
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    groups = [[("a", (2, 3), torch.bfloat16)], [("b", (3,), torch.float32), ("c", (1,), torch.bfloat16)]]
    bucket = Staging("cpu").bucket(plan_buckets(groups, 1 << 20)[0], 0)
    for i, (name, view) in enumerate(bucket.named()):
        view.copy_(torch.arange(view.numel()).view(view.shape) + 10 * i)
    payload = requests.bucket_payload(bucket, Metadata)
    rebuilt = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"])
    out = dict(rebuilt.reconstruct_tensors())
    assert list(out) == ["a", "b", "c"]
    assert all(torch.equal(out[n], v) and out[n].dtype == v.dtype for n, v in bucket.named())
    print("OK")
''')


@pytest.mark.skipif(not (ROOT / "sglang").exists(), reason="the pinned sglang types are not installed: "
                                                          "run `make sglang-types`")
def test_requests_against_the_pinned_sglang_types():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env_with_repo(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
