"""The vLLM backend's CUDA paths, the parts that need no GPU (and no vLLM: they run in the main venv):
the environment a rank's engine processes start with, the IPC handle's device rewrite, the engine
arguments on CUDA vs CPU, and what a publication does with a buffer that is not on the CPU.
Checked against vllm 0.32.0's source (the file:line in each function's docstring)."""

from __future__ import annotations

import asyncio
import inspect
import json
import pickle
import subprocess
import sys

import pytest
import torch

from hybridrl.backends.vllm import ipc
from hybridrl.backends.vllm.config import VLLMConfig
from hybridrl.backends.vllm.engine import VLLMEngine
from hybridrl.backends.vllm.launch import device_index, engine_args, engine_env, process_env
from hybridrl.backends.vllm.transport import bucket_wire, pack_bucket
from hybridrl.publication.transport_remote import delivery
from hybridrl.rollout.versions import Publication


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "max_position_embeddings": 4096}))
    return str(tmp_path)


# ------------------------------------------------------------------ 1. each engine on its rank's GPU

def test_each_rank_engine_process_starts_seeing_only_that_rank_gpu():
    """Rank k's engine-core process is spawned with CUDA_VISIBLE_DEVICES naming the rank's GPU alone: the
    k-th of the node's visible GPUs (as the launcher named them), so vLLM's device 0 is the rank's."""
    cfg = VLLMConfig()
    assert [engine_env(cfg, on_cuda=True, device_index=k, environ={})["CUDA_VISIBLE_DEVICES"]
            for k in range(4)] == ["0", "1", "2", "3"]
    node = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert engine_env(cfg, on_cuda=True, device_index=2, environ=node)["CUDA_VISIBLE_DEVICES"] == "6"
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-aaaa, GPU-bbbb"}
    assert engine_env(cfg, on_cuda=True, device_index=1, environ=uuids)["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"
    with pytest.raises(ValueError, match="not among this process's CUDA_VISIBLE_DEVICES"):
        engine_env(cfg, on_cuda=True, device_index=4, environ=node)
    env = engine_env(cfg, on_cuda=True, device_index=3, environ={})
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and "OMP_NUM_THREADS" not in env
    assert "CUDA_VISIBLE_DEVICES" not in engine_env(cfg, on_cuda=False, device_index=None, environ={})
    assert device_index(torch.device("cuda:5")) == 5


def test_the_spawned_child_inherits_the_rank_gpu_and_the_parent_keeps_its_own(monkeypatch):
    """What the engine does around vLLM's start: the variables are set while vLLM spawns its processes (a
    real child here), then this process's own come back."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    seen = []
    for rank in (1, 3):
        env = engine_env(VLLMConfig(), on_cuda=True, device_index=rank)
        with process_env(env):
            seen.append(subprocess.run([sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"],
                                       capture_output=True, text=True, check=True).stdout.strip())
        assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert seen == ["1", "3"]


# ------------------------------------------------------------------ 2. IPC handles by GPU UUID

def test_torch_rebuild_cuda_tensor_takes_the_device_where_the_rewrite_writes():
    from torch.multiprocessing import reductions

    params = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params[ipc.DEVICE_ARG] == "storage_device"


def test_a_handle_from_cuda_k_opens_on_the_receiver_index_of_that_gpu():
    """The trainer's cuda:3 is the worker's cuda:0 (it sees that GPU alone): the handle carries the UUID,
    the worker maps it to its own index; a GPU it does not see is named in the error."""
    calls = []

    def rebuild(*args):
        calls.append(args)
        return torch.zeros(1)

    sent_args = ("cls", (4,), (1,), 0, "storage", torch.uint8, 3, b"handle", 4, 0, False, b"ref", 0, b"ev", True)
    trainer_uuids = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]
    handle = (rebuild, ipc.with_device(sent_args, trainer_uuids[3]))
    ipc.open_handle(handle, local_uuids=["GPU-3"])
    assert calls[-1][ipc.DEVICE_ARG] == 0 and calls[-1][:6] == sent_args[:6] and calls[-1][7:] == sent_args[7:]
    ipc.open_handle(handle, local_uuids=["GPU-9", "GPU-3"])
    assert calls[-1][ipc.DEVICE_ARG] == 1
    with pytest.raises(ValueError, match="GPU-3 is not visible"):
        ipc.open_handle(handle, local_uuids=["GPU-0"])
    with pytest.raises(ValueError, match="CUDA tensor"):
        ipc.share(torch.zeros(2))


# ------------------------------------------------------------------ 3. the engine arguments on CUDA vs CPU

def test_the_kv_budget_is_vllm_own_sizing_on_cuda_and_a_fixed_one_on_cpu(model_dir):
    cfg = VLLMConfig()
    cuda = engine_args(cfg, model_dir, dtype="bfloat16", on_cuda=True, seed=0)
    cpu = engine_args(cfg, model_dir, dtype="float32", on_cuda=False, seed=0)
    assert "kv_cache_memory_bytes" not in cuda and cuda["gpu_memory_utilization"] == cfg.gpu_memory_utilization
    assert cpu["kv_cache_memory_bytes"] == 64 << 20 and "gpu_memory_utilization" not in cpu
    fixed = engine_args(VLLMConfig(kv_cache_mb=2048), model_dir, dtype="bfloat16", on_cuda=True, seed=0)
    assert fixed["kv_cache_memory_bytes"] == 2048 << 20         # asked for explicitly: applied


def test_cuda_graphs_are_on_by_default_on_cuda_and_cpu_stays_eager(model_dir):
    assert engine_args(VLLMConfig(), model_dir, dtype="bfloat16", on_cuda=True, seed=0)["enforce_eager"] is False
    assert engine_args(VLLMConfig(enforce_eager=True), model_dir, dtype="bfloat16", on_cuda=True,
                       seed=0)["enforce_eager"] is True
    cpu = engine_args(VLLMConfig(), model_dir, dtype="float32", on_cuda=False, seed=0)
    assert cpu["enforce_eager"] is True and cpu["enable_chunked_prefill"] is False
    assert cpu["max_num_batched_tokens"] == 4096 and "load_format" in cpu


# ------------------------------------------------------------------ 4. a buffer that is not on the CPU

def test_a_bucket_buffer_is_bytes_from_the_cpu_and_refused_from_another_device():
    encoding, data = bucket_wire(torch.arange(6, dtype=torch.uint8))
    assert encoding == "raw" and data == bytes(range(6))
    with pytest.raises(ValueError, match="not from meta"):
        bucket_wire(torch.empty(6, dtype=torch.uint8, device="meta"))


def test_packed_tensors_come_back_from_their_bucket():
    items = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int16)), ("c", torch.randn(2).double())]
    bucket = pack_bucket(items)
    for name, tensor in items:
        assert torch.equal(bucket.views[name], tensor)
        assert bucket.views[name].data_ptr() % tensor.element_size() == 0


def _stub_engine(spec):
    """A VLLMEngine with no vLLM behind it: what update_weights reads before it delivers."""
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._spec, engine._publication, engine._released = spec, Publication(spec, 0), set()
    return engine


def test_update_weights_with_device_tensors_sends_one_flat_bucket_and_reads_no_bytes_on_the_host():
    """A disaggregated rollout rank receives into a GPU buffer: the tensors must not go through `.numpy()`
    (a TypeError for a CUDA tensor); they go as one bucket on their device (meta stands in for CUDA here)."""
    spec = {"w": ((4, 2), torch.float32), "b": ((3,), torch.bfloat16)}
    engine = _stub_engine(spec)
    sent = []

    async def load_bucket(bucket, version, *, names=None, digests=None):
        sent.append((bucket, version, digests))

    engine.load_bucket = load_bucket
    items = [("w", torch.empty(4, 2, device="meta")), ("b", torch.empty(3, dtype=torch.bfloat16, device="meta"))]
    asyncio.run(engine.update_weights(items, 1, digests={"w": "x", "b": "y"}))
    (bucket, version, digests), = sent
    assert bucket.buffer.device.type == "meta" and version == 1 and digests == {"w": "x", "b": "y"}
    assert {n: (tuple(v.shape), v.dtype) for n, v in bucket.views.items()} == spec
    with pytest.raises(ValueError, match="one device"):
        asyncio.run(engine.update_weights([items[0], ("b", torch.zeros(3, dtype=torch.bfloat16))], 1))


def test_a_received_gpu_buffer_goes_whole_to_an_engine_that_takes_buckets():
    """The rollout rank's side of a disaggregated publication (`transport_remote.delivery`)."""
    from hybridrl.rollout.registry import ENGINES

    header = {"version": 2, "names": ["w"], "digests": {"w": "d", "v": "e"},
              "entries": [("w", (2, 2), torch.float32, 0, 16), ("v", (2,), torch.float32, 16, 24)]}
    calls = []

    class Engine:
        def load_bucket(self, bucket, version, *, names, digests):
            calls.append(("load_bucket", bucket.buffer.device.type, sorted(bucket.views), version, names, digests))

        def update_weights(self, items, version, *, digests):
            calls.append(("update_weights", [n for n, _ in items], version, digests))

    assert ENGINES.get("vllm").loads_flat_buckets and not ENGINES.get("native").loads_flat_buckets
    delivery(Engine(), torch.empty(24, dtype=torch.uint8, device="meta"), header, takes_buckets=True)
    delivery(Engine(), torch.zeros(24, dtype=torch.uint8), header, takes_buckets=True)
    delivery(Engine(), torch.empty(24, dtype=torch.uint8, device="meta"), header)       # an engine without it
    assert calls == [("load_bucket", "meta", ["v", "w"], 2, ["w"], {"w": "d"}),
                     ("update_weights", ["w"], 2, {"w": "d"}), ("update_weights", ["w"], 2, {"w": "d"})]


def test_the_worker_rebuild_of_a_pickled_handle_uses_the_uuid_mapping():
    """The bytes `bucket_wire` sends (a pickled handle) open through `ipc.open_handle` in the worker."""
    handle = (_fake_rebuild, ipc.with_device(tuple(range(15)), "GPU-7"))
    opened = ipc.open_handle(pickle.loads(pickle.dumps(handle)), local_uuids=["GPU-7"])
    assert opened[ipc.DEVICE_ARG] == 0


def _fake_rebuild(*args):
    return args


# ------------------------------------------------------------------ 5. mixture of experts: refused before launch

def test_vllm_with_a_moe_model_is_refused_in_preflight_with_the_reason(tiny_models, tmp_path):
    """`hybridrl train --check` (preflight, exit 2) refuses rollout.engine=vllm for a Qwen3-MoE model and says
    why and what to use; the same recipe with its native engine, and vLLM with a dense model, pass."""
    from tests.launch import ROOT, env_with_repo

    moe, dense = tiny_models("qwen3_moe"), tiny_models("qwen2")

    def check(model, *overrides):
        return subprocess.run([sys.executable, "-m", "hybridrl", "train", str(ROOT / "recipes" / "calc_grpo_cpu.yaml"),
                               "--check", f"model.path={model}", f"run.dir={tmp_path / 'run'}",
                               "train.share_prefix=false", *overrides],
                              cwd=ROOT, env=env_with_repo(), capture_output=True, text=True, timeout=300)

    refused = check(moe, "rollout.engine=vllm")
    assert refused.returncode == 2, refused.stderr
    assert "cannot serve the mixture-of-experts model" in refused.stderr and "rollout.engine=sglang" in refused.stderr
    assert "fused expert parameters" in refused.stderr and "routing records" in refused.stderr
    assert check(moe).returncode == 0
    assert check(dense, "rollout.engine=vllm").returncode == 0


def test_the_engine_itself_refuses_a_moe_model_before_starting_anything(tiny_models):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        VLLMEngine(tiny_models("qwen3_moe"), VLLMConfig())
