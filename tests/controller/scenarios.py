"""Jobs for the worker-group tests: each controller exercises one behaviour and writes what it
saw to <run.dir>/result.json for the test to check. Launched as `run.job=tests.controller.scenarios:NAME`."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridrl.distributed.dispatch import ONE_TO_ALL, DPSplit
from hybridrl.controller.worker_group import WorkerGroupError
from hybridrl.data.batch import Batch
from hybridrl.distributed.control import ControlMessageError
from hybridrl.distributed.mesh import Mesh
from hybridrl.jobs import Job
from hybridrl.workers.base import Worker, register


class ScenarioWorker(Worker):
    def __init__(self, cfg, ctx):
        super().__init__(ctx)
        self.cfg = cfg

    def meshes(self):
        w = self.ctx.world_size
        return {"world": Mesh.flat("world", w), "tp_all": Mesh("tp_all", ("dp", "tp"), (1, w))}

    @register(dispatch=DPSplit("world"))
    def shard_info(self, batch: Batch) -> Batch:
        n = len(batch)
        return Batch({"value": batch["value"] * 10, "rank": torch.full((n,), self.ctx.rank),
                      "padding_seen": torch.full((n,), batch.num_padding),
                      "loss_mask_sum": batch["loss_mask"].sum(dim=1)},
                     {"id": batch["id"]})

    @register(dispatch=DPSplit("tp_all"))
    def tp_shard(self, batch: Batch) -> Batch:
        # every rank of the single dp group gets the whole batch; only tp rank 0's output returns
        return Batch({"rank": torch.full((len(batch),), self.ctx.rank)}, {"id": batch["id"]})

    @register(dispatch=ONE_TO_ALL)
    def echo(self, value):
        return {"rank": self.ctx.rank, "value": value}

    @register(dispatch=ONE_TO_ALL)
    def raise_on(self, rank: int):
        if self.ctx.rank == rank:
            raise ValueError(f"boom from rank {rank} (scenario marker 7f3a)")

    @register(dispatch=ONE_TO_ALL)
    def raise_before_collective(self, rank: int):
        if self.ctx.rank == rank:
            raise ValueError(f"rank {rank} raised before the collective (marker c0ll)")
        t = torch.ones(1)
        dist.all_reduce(t, group=self.ctx.data_group)   # the others wait here for rank `rank`
        return float(t)

    @register(dispatch=ONE_TO_ALL)
    def die_on(self, rank: int):
        if self.ctx.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.ctx.rank

    @register(dispatch=ONE_TO_ALL)
    def die_in_collective(self, rank: int):
        if self.ctx.rank == rank:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.ones(1)
        dist.all_reduce(t, group=self.ctx.data_group)
        return float(t)

    @register(dispatch=ONE_TO_ALL)
    def sleep_on(self, rank: int, seconds: float):
        if self.ctx.rank == rank:
            time.sleep(seconds)
        return self.ctx.rank

    @register(dispatch=ONE_TO_ALL)
    def return_tensor(self):
        return {"x": torch.ones(4)}


def _write(cfg, result: dict) -> None:
    out = Path(cfg.run.dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result))


def _error_info(err: WorkerGroupError) -> dict:
    return {"rank": err.rank, "method": err.method, "kind": err.report.kind, "message": str(err),
            "traceback": err.remote_traceback}


def uneven(cfg, wg):
    results = {}
    for n in (1, 2, 5, 7):
        ids = [f"s{i}" for i in range(n)]
        batch = Batch({"value": torch.arange(n, dtype=torch.float32),
                       "loss_mask": torch.ones(n, 3)}, {"id": ids})
        out = wg.call(ScenarioWorker.shard_info, batch)
        results[n] = {"ids": out["id"], "value": out["value"].tolist(), "rank": out["rank"].tolist(),
                      "padding_seen": out["padding_seen"].tolist(), "num_padding": out.num_padding,
                      "loss_mask_sum": out["loss_mask_sum"].tolist()}
    tp = wg.call(ScenarioWorker.tp_shard, Batch({"x": torch.zeros(3)}, {"id": ["a", "b", "c"]}))
    echo = wg.call(ScenarioWorker.echo, value={"k": [1, 2]})
    try:
        wg.call(ScenarioWorker.echo, value=torch.ones(3))
        tensor_kwarg = "accepted"
    except ControlMessageError as err:
        tensor_kwarg = str(err)
    echo_after = wg.call(ScenarioWorker.echo, value=5)   # the group is still usable
    _write(cfg, {"uneven": results, "tp": {"ids": tp["id"], "rank": tp["rank"].tolist()}, "echo": echo,
                 "tensor_kwarg": tensor_kwarg, "echo_after": echo_after})


def _expect_failure(method, **kwargs):
    def controller(cfg, wg):
        try:
            wg.call(method, **kwargs)
        except WorkerGroupError as err:
            _write(cfg, {"error": _error_info(err)})
            raise
        _write(cfg, {"error": None})
    return controller


def tensor_output(cfg, wg):
    _expect_failure(ScenarioWorker.return_tensor)(cfg, wg)


def timeout(cfg, wg):
    try:
        wg.call(ScenarioWorker.sleep_on, rank=1, seconds=60, timeout_s=2)
    except WorkerGroupError as err:
        _write(cfg, {"error": _error_info(err)})
        raise


def controller_dies(cfg, wg):
    wg.call(ScenarioWorker.echo, value=1)
    os.kill(os.getpid(), signal.SIGKILL)


def clean(cfg, wg):
    _write(cfg, {"echo": wg.call(ScenarioWorker.echo, value="hi")})


UNEVEN = Job("uneven", ScenarioWorker, uneven)
RAISE = Job("raise", ScenarioWorker, _expect_failure(ScenarioWorker.raise_on, rank=1))
RAISE_ON_CONTROLLER = Job("raise0", ScenarioWorker, _expect_failure(ScenarioWorker.raise_on, rank=0))
RAISE_IN_COLLECTIVE = Job("rcoll", ScenarioWorker, _expect_failure(ScenarioWorker.raise_before_collective, rank=1))
DIE = Job("die", ScenarioWorker, _expect_failure(ScenarioWorker.die_on, rank=1))
DIE_IN_COLLECTIVE = Job("dcoll", ScenarioWorker, _expect_failure(ScenarioWorker.die_in_collective, rank=1))
TENSOR_OUTPUT = Job("tout", ScenarioWorker, tensor_output)
TIMEOUT = Job("timeout", ScenarioWorker, timeout)
CONTROLLER_DIES = Job("cdies", ScenarioWorker, controller_dies)
CLEAN = Job("clean", ScenarioWorker, clean)
