"""Where the training side puts its tensors, checked without a GPU: the device a collective needs
for its group's backend, every tensor of a micro-batch on the engine's device, and collected
batches on the controller's device (the meta device stands in for a GPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridrl.controller.worker_group import CONTROLLER_DEVICE, to_controller
from hybridrl.data.batch import Batch
from hybridrl.distributed.collectives import backend_device, collective_device
from tests.launch import free_port


def test_reductions_go_where_the_group_backend_reduces():
    # Megatron's data-parallel group on a GPU is NCCL: a CPU tensor there fails ("No backend type
    # associated with device type cpu"); gloo reduces CPU tensors only
    assert backend_device("nccl", torch.device("cpu")).type == "cuda"
    assert backend_device("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert backend_device("gloo", torch.device("cuda", 0)) == torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert collective_device(dist.group.WORLD, torch.device("meta")) == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_every_tensor_of_a_micro_batch_is_on_the_engine_device():
    from hybridrl.backends.megatron.schedule import micro_batches

    b = Batch({"input_ids": torch.ones(3, 5, dtype=torch.long),
               "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]),
               "loss_mask": torch.ones(3, 5), "old_logprobs": torch.zeros(3, 5), "advantages": torch.zeros(3, 5),
               "behavior_logprobs": torch.zeros(3, 5), "reward": torch.zeros(3), "group_index": torch.zeros(3)})
    mbs = micro_batches(b, 2, torch.device("meta"))
    assert [mb.shape for mb in mbs] == [(2, 4), (1, 2)]
    for mb in mbs:
        assert {t.device.type for t in mb.batch.tensors.values()} == {"meta"}, mb.batch
        assert mb.input_ids.device.type == mb.position_ids.device.type == mb.causal_mask.device.type == "meta"


def test_collected_batches_land_on_the_controller_device():
    assert CONTROLLER_DEVICE == torch.device("cpu")
    b = Batch({"x": torch.zeros(2, 3), "y": torch.ones(2)}, {"id": ["a", "b"]})
    moved = to_controller(b, torch.device("meta"))          # as if rank 0's output sat on another device
    assert {t.device.type for t in moved.tensors.values()} == {"meta"} and moved["id"] == ["a", "b"]
    assert to_controller(b) is b                             # already there: no copy
    assert to_controller({"loss": 1.0}) == {"loss": 1.0}     # other outputs as they are
