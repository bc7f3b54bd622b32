"""A stand-in for the `wandb` package (put this directory on PYTHONPATH): every call the Weights & Biases
callback makes, as one JSON line in $FAKE_WANDB_LOG."""

from __future__ import annotations

import json
import os


def _write(call: str, **data) -> None:
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, **data}, default=str) + "\n")


class _Summary(dict):
    def update(self, values):
        _write("summary.update", values=dict(values))


class _Run:
    summary = _Summary()

    def log(self, metrics, step=None):
        _write("log", step=step, keys=sorted(metrics), reward=metrics.get("reward/mean"))

    def finish(self, exit_code=0):
        _write("finish", exit_code=exit_code)


def init(**kwargs):
    _write("init", **{k: v for k, v in kwargs.items() if k != "config"},
           total_steps=kwargs["config"]["trainer"]["total_steps"])
    return _Run()
