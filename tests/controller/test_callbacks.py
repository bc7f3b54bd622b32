"""The callback API without ranks: events reach every observer in order, a failing callback is named and
switched off (the run goes on), a wrong `trainer.callbacks` entry is one line at load, and the shipped
Weights & Biases / MLflow callbacks step aside with a note when their package is missing (neither is a
dependency) and make the calls a tracker expects when it is there (a stand-in module)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.controller.callbacks import Events
from hybridrl.controller.integrations import MlflowCallback, WandbCallback


class Notes:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def on_step(self, step, metrics):
        self.calls.append((self.name, "step", step))

    def on_end(self, summary):
        self.calls.append((self.name, "end", summary["steps"]))


class Broken:
    def on_step(self, step, metrics):
        raise RuntimeError("my logging bug")


def test_events_reach_observers_in_order_and_a_broken_one_is_switched_off(caplog):
    calls = []
    events = Events([Notes("a", calls), Broken(), Notes("b", calls)])
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        events.emit("step", 1, {"reward/mean": 0.5})
        events.emit("step", 2, {"reward/mean": 0.6})
        events.emit("checkpoint", 2, "/x")          # no observer has on_checkpoint: nothing happens
        events.emit("end", {"steps": 2})
    assert calls == [("a", "step", 1), ("b", "step", 1), ("a", "step", 2), ("b", "step", 2), ("a", "end", 2),
                     ("b", "end", 2)]
    failed = [r for r in caplog.records if "Broken failed in on_step" in r.getMessage()]
    assert len(failed) == 1 and "my logging bug" in caplog.text and "off for the rest of the run" in caplog.text
    with pytest.raises(ValueError, match="unknown run event"):
        events.emit("stepp", 1, {})


@pytest.mark.parametrize("spec, says", [
    ("nosuchmodule_xyz:Thing", "cannot import nosuchmodule_xyz"),
    ("tests.controller.recording_callback:Nope", "has no 'Nope'"),
    ("justaname", "expected module:Class"),
])
def test_a_wrong_callback_entry_is_one_line_at_load(spec, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"trainer.callbacks=[{spec}]"])
    assert "trainer.callbacks" in str(err.value) and says in str(err.value) and "\n" not in str(err.value)


def test_shipped_callbacks_without_their_package_are_skipped_with_a_note(caplog, monkeypatch):
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)      # absent whatever is installed: import raises
    with caplog.at_level(logging.WARNING, logger="hybridrl"):
        events = Events.from_specs(["wandb", "mlflow", "tests.controller.recording_callback:Recorder"])
    assert [type(o).__name__ for o in events.observers] == ["Recorder"]
    notes = [r.getMessage() for r in caplog.records]
    assert notes == ["trainer.callbacks: wandb is not installed (pip install wandb); the Weights & Biases callback "
                     "is off for this run",
                     "trainer.callbacks: mlflow is not installed (pip install mlflow); the MLflow callback is off "
                     "for this run"]


def test_neither_tracker_is_a_dependency():
    """With the real packages absent (the default install has neither), a recipe naming both loads and
    their callbacks stand aside."""
    import importlib.util

    if importlib.util.find_spec("wandb") or importlib.util.find_spec("mlflow"):
        pytest.skip("wandb or mlflow is installed here")
    assert load_config(None, ["trainer.callbacks=[wandb,mlflow]"]).trainer.callbacks == ["wandb", "mlflow"]
    assert not WandbCallback().available and not MlflowCallback().available


def test_mlflow_callback_makes_the_calls_mlflow_expects(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("mlflow")
    fake.start_run = lambda **kw: calls.append(("start_run", kw)) or types.SimpleNamespace(
        info=types.SimpleNamespace(run_id="abc123"))
    fake.log_params = lambda params: calls.append(("log_params", len(params)))
    fake.log_metrics = lambda metrics, step: calls.append(("log_metrics", step, metrics))
    fake.set_tag = lambda key, value: calls.append(("set_tag", key, value))
    fake.end_run = lambda status: calls.append(("end_run", status))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    config = {"trainer": {f"k{i}": i for i in range(150)}, "run": {"name": "x"}}
    cb = MlflowCallback()
    cb.on_start({"run_dir": str(tmp_path), "name": "x", "config": config})
    cb.on_step(3, {"reward/mean": 0.5, "train/updated": 1.0, "note": "text"})
    cb.on_checkpoint(3, "/ckpt")
    cb.on_end({"steps": 3})
    assert calls[0] == ("start_run", {"run_name": "x"})
    assert [c for c in calls if c[0] == "log_params"] == [("log_params", 100), ("log_params", 51)]
    assert ("log_metrics", 3, {"reward/mean": 0.5, "train/updated": 1.0}) in calls
    assert calls[-2:] == [("set_tag", "checkpoint", "/ckpt"), ("end_run", "FINISHED")]
    again = MlflowCallback()                                       # a resumed run continues the MLflow run
    calls.clear()
    again.on_start({"run_dir": str(tmp_path), "name": "x", "config": config})
    assert calls == [("start_run", {"run_id": "abc123"})]
