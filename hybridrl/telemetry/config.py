"""The `telemetry` section: the run's timeline (`telemetry/spans.py`) and OpenTelemetry traces of its episodes
and steps (`telemetry/otel.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrl.config.fields import ConfigValueError, check_choice, check_range, knob

TRACES = ("off", "file", "otlp")
# YAML 1.1 reads a bare `off` (and no / false) as a boolean, which a string field receives as "False"
_OFF = ("False", "false", "off", "no", "none", "")


@dataclass(kw_only=True)
class TelemetryConfig:
    """What the run records of its own timing: its timeline, and traces for tracing tools (Jaeger, Tempo, an
    OpenTelemetry collector)."""

    timeline: bool = knob(True, "record what each rank did and when (the RL loop's stages, mode-switch phases, "
                                "generation, train passes, waits) to <run.dir>/timeline/, a few small appends per step; "
                                "`hybridrl inspect RUN --timeline` draws it")
    traces: str = knob("off", "off | file: OpenTelemetry spans, one trace per episode (its turns with prefill / "
                              "decode, tool calls, environment steps, reward, and the update that trained it) and one "
                              "per step, written as OTLP JSON lines to <run.dir>/traces.otlp.jsonl | otlp: sent to "
                              "telemetry.trace_endpoint. Needs 'hybridrl[otel]'")
    trace_endpoint: str = knob("", "traces=otlp: the OTLP/HTTP traces endpoint, e.g. http://localhost:4318/v1/traces "
                                   "(empty: the exporter's default, or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    trace_sample: float = knob(1.0, "share of episodes traced (chosen by their trajectory id, so every rank and a "
                                    "rerun choose the same); every step is traced")

    def __post_init__(self) -> None:
        if str(self.traces) in _OFF:
            self.traces = "off"
        check_choice("traces", self.traces, TRACES)
        check_range("trace_sample", self.trace_sample, 0.0, 1.0)
        if self.traces != "off":
            wanted = ["opentelemetry.sdk"] + (["opentelemetry.exporter.otlp.proto.http"] if self.traces == "otlp" else [])
            if any(_missing(m) for m in wanted):
                raise ConfigValueError("traces", f"telemetry.traces={self.traces} needs OpenTelemetry: pip install "
                                                 "'hybridrl[otel]', or set telemetry.traces=off")


def _missing(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True
