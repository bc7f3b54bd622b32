"""Live metrics while the run lives: Prometheus text served from rank 0 (`trainer.metrics_port`, 0 = off).

    hybridrl_steps_total              RL steps logged by this process (a counter: rate() gives steps/s)
    hybridrl_step                     the last logged step
    hybridrl_phase{phase="..."}       1 for the stage the controller is in now (sync, rollout, prep, train,
                                      validate, store, checkpoint; idle between them), 0 for the others
    hybridrl_<metric>                 each scalar of the last logged step (metrics.jsonl's keys, with
                                      every character outside [a-zA-Z0-9_] as `_`: reward/mean ->
                                      hybridrl_reward_mean; queue depths and policy lag are among them
                                      where the run measures them)
    hybridrl_incidents_total{kind}    incidents counted by `count_incident(kind)`

The server is `prometheus_client`'s (the `metrics` extra), on its own thread; a scrape reads a snapshot
of the last step under a lock and never waits for the loop. Off, nothing is imported or started, and
`count_incident` / `set_phase` are a dictionary update and an assignment.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from typing import Any

_INCIDENTS: Counter = Counter()
_PHASE = ["idle"]
PHASES = ("idle", "sync", "rollout", "prep", "train", "validate", "store", "checkpoint")


def count_incident(kind: str) -> None:
    """One more incident of `kind` (served as hybridrl_incidents_total{kind=...})."""
    _INCIDENTS[kind] += 1


def set_phase(name: str) -> str:
    """The controller's stage from now on; returns the one it replaces (to restore at the stage's end)."""
    before, _PHASE[0] = _PHASE[0], name
    return before


def metric_name(key: str) -> str:
    return "hybridrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class LiveMetrics:
    """A run observer (`controller/callbacks.py`) that serves the run's metrics over HTTP."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._step = 0
        self._steps = 0
        self._server: Any = None

    def on_start(self, run: dict) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        self._step = int(run.get("step", 0))
        try:
            self._server, _ = start_http_server(self.port, addr=self.host, registry=registry)
        except OSError as err:
            raise OSError(f"trainer.metrics_port={self.port}: cannot serve metrics on {self.host}:{self.port} "
                          f"({err.strerror or err}); pick a free port, or 0 for none") from None

    def on_step(self, step: int, metrics: dict) -> None:
        snapshot = {k: float(v) for k, v in metrics.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}
        with self._lock:
            self._last, self._step = snapshot, step
            self._steps += step > 0                  # step 0's row is the validation before any update

    def on_end(self, summary: dict) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def collect(self):
        """The prometheus_client collector protocol: what a scrape sees now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            last, step, steps = dict(self._last), self._step, self._steps
        yield CounterMetricFamily("hybridrl_steps", "RL steps logged since this process started", value=steps)
        yield GaugeMetricFamily("hybridrl_step", "the last logged RL step", value=step)
        phase = GaugeMetricFamily("hybridrl_phase", "1 for the controller's current stage", labels=["phase"])
        current = _PHASE[0]
        for name in dict.fromkeys((*PHASES, current)):
            phase.add_metric([name], float(name == current))
        yield phase
        incidents = CounterMetricFamily("hybridrl_incidents", "incidents of the run, by kind", labels=["kind"])
        for kind, n in sorted(_INCIDENTS.items()):
            incidents.add_metric([kind], n)
        yield incidents
        seen = {"hybridrl_step", "hybridrl_steps", "hybridrl_phase", "hybridrl_incidents"}
        for key, value in sorted(last.items()):
            name = metric_name(key)
            if name not in seen:
                seen.add(name)
                yield GaugeMetricFamily(name, f"{key} of the last logged step", value=value)


def observers(host: str, port: int) -> list[Any]:
    """The run's live-metrics observer (none with port 0)."""
    return [LiveMetrics(host, port)] if port else []
