"""The self-check job: proves the worker group on this machine (dispatch, collect, errors).

Each check computes something on the workers that the controller can verify independently, so
a broken dispatch or collect fails loudly. With `selfcheck.fail_rank=K` the last check raises on
rank K, and the run must end with an error naming rank K (what `hybridrl doctor` verifies).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import torch

from hybridrl.distributed.dispatch import ONE_TO_ALL, DPSplit, OneToAll, RANK0
from hybridrl.data.batch import Batch
from hybridrl.workers.base import Worker, register

log = logging.getLogger(__name__)


class SelfCheckWorker(Worker):
    def __init__(self, cfg, ctx):
        super().__init__(ctx)
        self.cfg = cfg

    @register(dispatch=ONE_TO_ALL)
    def whoami(self) -> dict:
        return {"rank": self.ctx.rank, "pid": os.getpid(), "host": socket.gethostname(),
                "node_rank": int(os.environ.get("GROUP_RANK", 0)),
                "device": str(self.ctx.device), "data_backend": self.ctx.data_backend}

    @register(dispatch=DPSplit("world"))
    def affine(self, batch: Batch, scale: float) -> Batch:
        """y = scale * x + rank: the controller checks both the values and who computed them."""
        x = batch["x"]
        out = Batch({"y": scale * x + self.ctx.rank, "rank": torch.full((len(batch),), self.ctx.rank)},
                    {"id": batch["id"]})
        return out

    @register(dispatch=OneToAll("rank0"))
    def all_reduce_sum(self, batch: Batch) -> float:
        """Sum of x over ranks' slices of a broadcast batch, reduced on the data plane."""
        x = batch["x"].to(self.ctx.device)
        mine = x[self.ctx.rank :: self.ctx.world_size].sum()
        self.ctx.data_peers.all_reduce(mine)
        return float(mine)

    @register(dispatch=RANK0)
    def controller_only(self) -> int:
        return self.ctx.rank

    @register(dispatch=ONE_TO_ALL)
    def fail_on(self, rank: int) -> None:
        if self.ctx.rank == rank:
            raise RuntimeError(f"injected failure on rank {rank} (selfcheck.fail_rank)")


def run_selfcheck(cfg, wg) -> dict:
    world = wg.world_size
    report: dict = {"world_size": world, "checks": {}}
    started = time.perf_counter()

    ranks = wg.call(SelfCheckWorker.whoami)
    assert [r["rank"] for r in ranks] == list(range(world)), ranks
    report["ranks"] = ranks
    report["checks"]["dispatch_one_to_all"] = "ok"

    n = cfg.selfcheck.batch_size
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    batch = Batch({"x": x}, {"id": [f"s{i}" for i in range(n)]})
    out = wg.call(SelfCheckWorker.affine, batch, scale=2.0)
    mesh = wg.mesh("world")
    chunk = -(-n // mesh.dp_size)
    expected_rank = torch.tensor([mesh.output_ranks()[i // chunk] for i in range(n)])
    assert len(out) == n and out["id"] == batch["id"], f"collect returned {len(out)} rows / ids {out['id']}"
    assert torch.equal(out["rank"], expected_rank), (out["rank"], expected_rank)
    assert torch.allclose(out["y"], 2.0 * x + expected_rank.unsqueeze(1).float())
    report["checks"]["dispatch_dp_split_uneven"] = f"ok ({n} rows over {mesh.dp_size} ranks)"

    total = wg.call(SelfCheckWorker.all_reduce_sum, batch)
    assert abs(total - float(x.sum())) < 1e-4, (total, float(x.sum()))
    report["checks"]["broadcast_and_collective"] = "ok"

    assert wg.call(SelfCheckWorker.controller_only) == 0
    report["checks"]["rank0_only"] = "ok"
    report["seconds"] = round(time.perf_counter() - started, 3)

    out_dir = Path(cfg.run.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "selfcheck.json").write_text(json.dumps(report, indent=2))
    for name, result in report["checks"].items():
        log.info("selfcheck %-26s %s", name, result)
    print(f"selfcheck: {world} ranks, {len(report['checks'])} checks passed in {report['seconds']}s")

    if cfg.selfcheck.fail_rank >= 0:
        wg.call(SelfCheckWorker.fail_on, rank=cfg.selfcheck.fail_rank)  # raises WorkerGroupError
    return report
