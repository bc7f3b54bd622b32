"""Where a publication's CUDA work happens, checked on CPU: the helper thread that prepares buckets
takes the staging device as its current device (a new thread's is GPU 0), the staging buffers go
back to the driver when released, and the parity tolerance a run can pass follows its dtypes."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from hybridrl.publication import publish as publish_mod
from hybridrl.publication.buckets import Staging
from hybridrl.publication.config import PublishConfig, default_parity_tolerance, parity_tolerance_floor
from hybridrl.publication.publish import TensorGroups, prepare_thread, publish
from hybridrl.publication.transport_inprocess import InProcessTransport
from hybridrl.rollout.follower import FollowerEngine


@pytest.fixture
def set_device_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append((threading.current_thread().name, index)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    return calls


def test_the_helper_thread_runs_on_the_staging_device(set_device_calls):
    with prepare_thread(torch.device("cuda", 2)) as helper:
        seen = helper.submit(lambda: list(set_device_calls)).result()
    assert seen == [("publish-prepare_0", 2)]               # bound in the thread itself, before any task
    set_device_calls.clear()
    with prepare_thread(torch.device("cuda")) as helper:      # index-less: the caller's current device
        helper.submit(lambda: None).result()
    assert set_device_calls == [("publish-prepare_0", 5)]
    set_device_calls.clear()
    with prepare_thread(torch.device("cpu")) as helper:
        helper.submit(lambda: None).result()
    assert set_device_calls == []


def test_publish_prepares_on_its_staging_device(monkeypatch):
    devices = []
    real = publish_mod.prepare_thread
    monkeypatch.setattr(publish_mod, "prepare_thread", lambda device: devices.append(device) or real(device))
    n = 200_000                                   # 0.8 MB a tensor: two 1 MiB buckets
    tensors = [[("w", torch.ones(n))], [("v", torch.ones(n))]]
    engine = FollowerEngine({"w": ((n,), torch.float32), "v": ((n,), torch.float32)}, eos_token_ids=(), vocab_size=4,
                            max_model_len=0)
    hashes = {"model_config_hash": "m", "tokenizer_hash": "t", "chat_template_hash": "c"}
    asyncio.run(publish(TensorGroups(tensors), engine=engine, transport=InProcessTransport(engine),
                        cfg=PublishConfig(verify="structure", bucket_mb=1), version=1, step=1, staging=Staging("cpu"),
                        hashes=hashes))
    assert devices == [torch.device("cpu")] and engine.policy_version == 1
    # one bucket has nothing to overlap: prepared in the caller's thread, no helper
    asyncio.run(publish(TensorGroups(tensors), engine=engine, transport=InProcessTransport(engine),
                        cfg=PublishConfig(verify="structure"), version=2, step=2, staging=Staging("cpu"), hashes=hashes))
    assert devices == [torch.device("cpu")] and engine.policy_version == 2


def test_released_cuda_staging_goes_back_to_the_driver(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    staging = Staging(torch.device("cuda", 0))
    staging.release()
    assert emptied == []                                      # held nothing: nothing to hand back
    staging._buffers[0] = torch.empty(16, dtype=torch.uint8)  # as if a bucket had been written there
    staging.release()
    assert emptied == [1] and staging.nbytes == 0
    cpu = Staging("cpu")
    cpu._buffers[0] = torch.empty(16, dtype=torch.uint8)
    cpu.release()
    assert emptied == [1]


def test_parity_tolerance_follows_the_dtypes():
    assert parity_tolerance_floor("float32", "float32") == 0.0
    assert parity_tolerance_floor("float32", torch.bfloat16) == parity_tolerance_floor("float16") == 2.0 ** -6
    assert default_parity_tolerance("float32", "float32") == PublishConfig().parity_tolerance == 1e-3
    assert default_parity_tolerance("bfloat16", "bfloat16") == 0.1 > parity_tolerance_floor("bfloat16")
