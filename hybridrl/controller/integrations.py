"""Shipped callbacks for experiment trackers: `trainer.callbacks: [wandb]`, `[mlflow]` (or both).

Neither package is a dependency of hybridrl: each is imported when the run starts, and when it is
not installed the callback says so in one line and stays off (the run goes on). Both read their
usual environment: W&B `WANDB_PROJECT` (default "hybridrl"), `WANDB_ENTITY`, `WANDB_MODE`...;
MLflow `MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`. A resumed run continues the tracker's run
(its id is kept in the run directory); the steps a resume does again are logged again.
"""

from __future__ import annotations

import importlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _optional(package: str, what: str) -> Any:
    try:
        return importlib.import_module(package)
    except ImportError:
        log.warning("trainer.callbacks: %s is not installed (pip install %s); the %s callback is off for this run",
                    package, package, what)
        return None


def _run_id(run_dir: str, name: str) -> str | None:
    path = Path(run_dir) / name
    if not path.exists():
        return None
    return path.read_text().strip() or None


def _keep_run_id(run_dir: str, name: str, run_id: str) -> None:
    (Path(run_dir) / name).write_text(run_id + "\n")


def _numbers(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


class WandbCallback:
    """Weights & Biases: one W&B run per hybridrl run; every step's metrics, the config, the summary."""

    ID_FILE = "wandb_run_id"

    def __init__(self):
        self.wandb = _optional("wandb", "Weights & Biases")
        self.available = self.wandb is not None
        self.run = None

    def on_start(self, run: dict) -> None:
        run_id = _run_id(run["run_dir"], self.ID_FILE) or uuid.uuid4().hex[:16]
        _keep_run_id(run["run_dir"], self.ID_FILE, run_id)
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "hybridrl"), name=run["name"],
                                   id=run_id, resume="allow", config=run["config"], dir=run["run_dir"])

    def on_step(self, step: int, metrics: dict) -> None:
        self.run.log(_numbers(metrics), step=step)

    def on_interrupt(self, info: dict) -> None:
        self.run.finish(exit_code=info["exit_code"])

    def on_end(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        self.run.finish()


class MlflowCallback:
    """MLflow: one MLflow run per hybridrl run; the config as parameters, every step's metrics."""

    ID_FILE = "mlflow_run_id"

    def __init__(self):
        self.mlflow = _optional("mlflow", "MLflow")
        self.available = self.mlflow is not None

    def on_start(self, run: dict) -> None:
        earlier = _run_id(run["run_dir"], self.ID_FILE)
        active = self.mlflow.start_run(run_id=earlier) if earlier else self.mlflow.start_run(run_name=run["name"])
        _keep_run_id(run["run_dir"], self.ID_FILE, active.info.run_id)
        if not earlier:
            params = sorted(_flat(run["config"]).items())
            for i in range(0, len(params), 100):           # MLflow takes at most 100 parameters per call
                self.mlflow.log_params(dict(params[i:i + 100]))

    def on_step(self, step: int, metrics: dict) -> None:
        self.mlflow.log_metrics(_numbers(metrics), step=step)

    def on_checkpoint(self, step: int, path: str) -> None:
        self.mlflow.set_tag("checkpoint", path)

    def on_interrupt(self, info: dict) -> None:
        self.mlflow.end_run(status="KILLED")

    def on_end(self, summary: dict) -> None:
        self.mlflow.end_run(status="FINISHED")
