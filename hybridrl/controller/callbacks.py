"""The run's events, for whoever wants to hear them: `trainer.callbacks: [module:Class, ...]`.

A callback is any class (built with no arguments) with some of these methods; each gets plain data
(numbers, strings, paths), on the controller (rank 0), in this order:

    on_start(run)                  run: run_dir, name, step (0, or the checkpoint's step when resumed),
                                   total_steps, resumed_from, config (the resolved config as a dict),
                                   earlier_metrics (metrics.jsonl's rows up to that step)
    on_step(step, metrics)         after each step is logged: what metrics.jsonl holds for it
    on_validation(step, metrics)   when that step validated (also step 0's, before any update): the
                                   `val/*` metrics
    on_checkpoint(step, path)      a checkpoint is complete
    on_interrupt(info)             SIGINT / SIGTERM: info has signal, step, checkpoint, command
    on_end(summary)                the run finished (or stopped early): the end-of-run summary

Callbacks observe; they do not steer the run. One that raises is named in a warning with its
traceback and is off for the rest of the run (a logging bug never costs a run). Shipped ones are
named without a module: `wandb` (Weights & Biases) and `mlflow` (`controller/integrations.py`),
skipped with a one-line note when their package is not installed.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from hybridrl.registry import Registry

log = logging.getLogger(__name__)

EVENTS = ("start", "step", "validation", "checkpoint", "interrupt", "end")
SHIPPED = {"wandb": "hybridrl.controller.integrations:WandbCallback",
           "mlflow": "hybridrl.controller.integrations:MlflowCallback"}


class Callback:
    """A base to subclass (optional: any object with some `on_<event>` methods will do)."""

    def on_start(self, run: dict) -> None: ...

    def on_step(self, step: int, metrics: dict) -> None: ...

    def on_validation(self, step: int, metrics: dict) -> None: ...

    def on_checkpoint(self, step: int, path: str) -> None: ...

    def on_interrupt(self, info: dict) -> None: ...

    def on_end(self, summary: dict) -> None: ...


def _a_class(entry: Any) -> str | None:
    return None if isinstance(entry, type) else f"{entry!r} is not a class"


CALLBACKS: Registry[type] = Registry("callback", key="callbacks", shipped=SHIPPED, accept=_a_class, own="Class")


def resolve(spec: str) -> type:
    """`module:Class` (or a shipped name) -> the class; ConfigValueError naming `callbacks`."""
    return CALLBACKS.get(spec)


class Events:
    """Hands each event to every observer that has a method for it, in order."""

    def __init__(self, observers: Iterable[Any] = ()):
        self.observers = list(observers)

    @classmethod
    def from_specs(cls, specs: Sequence[str], builtin: Iterable[Any] = ()) -> "Events":
        """The run's own observers (progress, the learning-signal watch) first, then `trainer.callbacks`."""
        observers = list(builtin)
        for spec in specs:
            observer = resolve(spec)()
            if spec not in SHIPPED or observer.available:     # a shipped integration whose package is missing
                observers.append(observer)
        return cls(observers)

    def emit(self, event: str, *args: Any) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown run event {event!r} (one of {EVENTS})")
        for observer in list(self.observers):
            method = getattr(observer, f"on_{event}", None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception:  # noqa: BLE001 - a callback's bug must not end the run
                log.warning("callback %s failed in on_%s; it is off for the rest of the run",
                            type(observer).__qualname__, event, exc_info=True)
                self.observers.remove(observer)
