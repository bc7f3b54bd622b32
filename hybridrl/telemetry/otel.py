"""OpenTelemetry traces of the run (`telemetry.traces: file | otlp`; the `otel` extra), on rank 0.

One trace per step, `step N`: its stages on the controller (sync, rollout, prep, train, validate, store).
One trace per episode (a `telemetry.trace_sample` share of them, chosen by trajectory id), `episode`:

    episode                       hybridrl.trajectory_id / trace_id (the run ledger's), step, reward, ...
      turn <i>
        generate                  one inference request: tokens, policy version, finish reason, queued_s
          prefill / decode
        tool:<name>               a tool call that ran (ok, turn)
        env_step                  an environment transition
      reward                      the verifier's total
      update                      the update that trained on it (its step's train stage), linked to the
                                  step's trace

The episode's OpenTelemetry trace id is the ledger's trace id (64 bits) padded to 128 with zeros, so a
trace found in a tracing tool leads to `hybridrl inspect RUN <trace id>` and back.

Nothing here runs in the agent loop: the episodes' events already travel with each trajectory, stamped
with their wall-clock times (`data/trace.py`). After a step is logged the controller hands a snapshot of
them to one background thread, which makes the step's spans (with their recorded times) and hands them to
the exporter at once; the step's own thread does no more than copy references. Off, this module is
not imported. `file` writes OTLP JSON (one ExportTraceServiceRequest per line, ids in hex, as the
OpenTelemetry collector's file exporter does) to <run.dir>/traces.otlp.jsonl.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any

from hybridrl.telemetry import spans

log = logging.getLogger(__name__)

TRACE_FILE = "traces.otlp.jsonl"
_STEP_STAGES = ("sync", "rollout", "prep", "train", "validate", "store")


def sampled(trajectory_id: str, share: float) -> bool:
    """Whether an episode is traced: the same answer for the same id, on any rank and in any rerun."""
    if share >= 1.0:
        return True
    return int(hashlib.sha256(trajectory_id.encode()).hexdigest()[:8], 16) < share * 2 ** 32


def otel_trace_id(ledger_trace_id: str) -> int:
    """The ledger's 64-bit trace id (16 hex) as a 128-bit OpenTelemetry trace id."""
    return int(ledger_trace_id, 16)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _attributes(args: dict) -> dict:
    return {f"hybridrl.{k}": v for k, v in args.items() if isinstance(v, (str, bool, int, float))}


class OtlpJsonFile:
    """A span exporter writing OTLP JSON lines (the SDK's SpanExporter protocol). The JSON is made here from
    the spans' fields, as OTLP's JSON encoding lays them out (ids in hex, 64-bit integers and nanosecond
    times as strings, enums by name, fields at their defaults left out): going through the SDK's protobuf
    encoder and protobuf's JSON mapping cost three times as much CPU as making the spans."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a")

    def export(self, sdk_spans) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._file.write(json.dumps(otlp_json(sdk_spans), separators=(",", ":")) + "\n")
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, *_: Any) -> bool:
        self._file.flush()
        return True


def otlp_json(sdk_spans) -> dict:
    """An ExportTraceServiceRequest in OTLP JSON: the spans grouped by resource, then instrumentation scope."""
    resources: dict[int, tuple[Any, dict[Any, list]]] = {}
    for span in sdk_spans:
        _, scopes = resources.setdefault(id(span.resource), (span.resource, {}))
        scopes.setdefault(span.instrumentation_scope, []).append(_otlp_span(span))
    return {"resourceSpans": [{"resource": {"attributes": _otlp_attributes(resource.attributes)},
                               "scopeSpans": [{"scope": _otlp_scope(scope), "spans": found}
                                              for scope, found in scopes.items()]}
                              for resource, scopes in resources.values()]}


def _otlp_span(span) -> dict:
    context, parent = span.context, span.parent
    out: dict[str, Any] = {"traceId": f"{context.trace_id:032x}", "spanId": f"{context.span_id:016x}"}
    if parent is not None:
        out["parentSpanId"] = f"{parent.span_id:016x}"
    out.update(name=span.name, kind=f"SPAN_KIND_{span.kind.name}", startTimeUnixNano=str(span.start_time),
               endTimeUnixNano=str(span.end_time))
    if span.attributes:
        out["attributes"] = _otlp_attributes(span.attributes)
    if span.events:
        out["events"] = [{"timeUnixNano": str(e.timestamp), "name": e.name,
                          **({"attributes": _otlp_attributes(e.attributes)} if e.attributes else {})}
                         for e in span.events]
    if span.links:
        out["links"] = [{"traceId": f"{link.context.trace_id:032x}", "spanId": f"{link.context.span_id:016x}",
                         **({"attributes": _otlp_attributes(link.attributes)} if link.attributes else {}),
                         "flags": _otlp_flags(link.context)} for link in span.links]
    status, out["status"] = span.status, {}
    if status.status_code.name != "UNSET":
        out["status"]["code"] = f"STATUS_CODE_{status.status_code.name}"
        if status.description:
            out["status"]["message"] = status.description
    out["flags"] = _otlp_flags(parent)
    return out


def _otlp_flags(context) -> int:
    """OTLP's span flags: bit 8 says whether bit 9 (the parent or linked context is remote) is known."""
    return 0x100 | (0x200 if context is not None and context.is_remote else 0)


def _otlp_scope(scope) -> dict:
    return {"name": scope.name, **({"version": scope.version} if scope.version else {})}


def _otlp_attributes(attributes) -> list[dict]:
    return [{"key": key, "value": _otlp_value(value)} for key, value in attributes.items()]


def _otlp_value(value: Any) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [_otlp_value(v) for v in value]} if value else {}}
    return {"stringValue": str(value)}


class RunTracer:
    """Spans of the run's steps and episodes, made on a background thread from snapshots.

    The spans are the SDK's `ReadableSpan`s made whole (name, ids, parent, times, attributes, links), as a
    span ends in the SDK, and handed to its exporter a step at a time: the trace ids are the ledger's, the
    times were recorded during the step, and the batching is per step, so the SDK's tracer, its context
    propagation and its batch processor (five times the CPU of the spans themselves) have nothing to add.
    Span ids come from a generator of its own (never the global `random`: the run's draws are the same
    with tracing on or off)."""

    BATCH = 8192                          # spans per export call (a step of a large run makes thousands)

    def __init__(self, cfg: Any, run_dir: str | Path, run_name: str):
        import os
        import random

        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import SpanContext, TraceFlags

        self._readable, self._context = ReadableSpan, SpanContext        # made per span: looked up once here
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self.share = cfg.trace_sample
        if cfg.traces == "file":
            self.path: Path | None = Path(run_dir) / TRACE_FILE
            self.exporter: Any = OtlpJsonFile(self.path)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.path, self.exporter = None, OTLPSpanExporter(endpoint=cfg.trace_endpoint or None)
        self.resource = Resource.create({"service.name": "hybridrl", "hybridrl.run": run_name})
        self.scope = InstrumentationScope("hybridrl")
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name="hybridrl-otel", daemon=True)
        self._thread.start()

    # on the controller's thread: a snapshot, no spans
    def step(self, step: int, metrics: dict, trajectories: list) -> None:
        current = spans.current_step()
        episodes = [(t.trajectory_id, t.trace_id, t.metadata.get("trace", []), t.timings, t.reward, t.status.value,
                     "advantage" in t.metadata, t.metadata.get("engine_rank"))
                    for t in trajectories if sampled(t.trajectory_id, self.share)]
        self._queue.put((step, current, dict(metrics), episodes))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)
        self.exporter.shutdown()

    # on the background thread
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, current, metrics, episodes = item
            made: list[Any] = []
            try:
                link, train = self._step_trace(step, current, metrics, made)
                for episode in episodes:
                    self._episode_trace(step, episode, link, train, made)
                for i in range(0, len(made), self.BATCH):
                    self.exporter.export(made[i:i + self.BATCH])
            except Exception:  # noqa: BLE001 - tracing must never cost the run
                log.warning("tracing step %d failed; its spans are incomplete", step, exc_info=True)

    def _span(self, made: list, name: str, trace_id: int, parent: Any, start: float, end: float,
              attributes: dict | None = None, links: tuple = ()) -> Any:
        """A finished span of `trace_id` under `parent` (a SpanContext, None for a root), appended to `made`;
        returns its context (the parent of the spans under it)."""
        context = self._context(trace_id, self._rng.getrandbits(64) or 1, is_remote=False,
                                trace_flags=self._sampled)
        made.append(self._readable(name, context, parent, resource=self.resource, attributes=attributes or {},
                                   links=links, instrumentation_scope=self.scope, start_time=_ns(start),
                                   end_time=_ns(end)))
        return context

    def _step_trace(self, step: int, current, metrics: dict, made: list):
        """The step's trace; returns its root's context (for links) and its train stage (start, end)."""
        if current is None or current[0] != step:
            return None, None
        _, start, stages = current
        end = max([start] + [e for _, _, e in stages])
        root = self._span(made, f"step {step}", self._rng.getrandbits(128) or 1, None, start, end, attributes={
            "hybridrl.step": step, **_attributes({k.replace("/", "."): v for k, v in metrics.items()
                                                  if k in ("reward/mean", "loss", "policy/version", "episodes")})})
        train = None
        for name, s, e in stages:
            if name in _STEP_STAGES:
                self._span(made, name, root.trace_id, root, s, e)
                if name == "train":
                    train = (s, e)
        return root, train

    def _episode_trace(self, step: int, episode: tuple, link, train, made: list) -> None:
        from opentelemetry import trace

        tid, ledger_trace, events, timings, reward, status, consumed, engine = episode
        found = [s for s in spans.episode_spans(events, timings) if s[0] != "queued"]   # an attribute here
        if not found:
            return
        trace_id = otel_trace_id(ledger_trace)
        contexts: list[Any] = []
        for name, start, end, args, _, parent in spans.nest(found):
            attributes = _attributes(args)
            if parent < 0:
                attributes.update({"hybridrl.trajectory_id": tid, "hybridrl.trace_id": ledger_trace,
                                   "hybridrl.step": step, "hybridrl.reward": float(reward), "hybridrl.status": status})
                if engine is not None:
                    attributes["hybridrl.engine_rank"] = int(engine)
            contexts.append(self._span(made, name, trace_id, contexts[parent] if parent >= 0 else None, start, end,
                                       attributes))
        if consumed and train is not None:
            self._span(made, "update", trace_id, contexts[0], train[0], train[1], {"hybridrl.update_step": step},
                       links=(trace.Link(link),) if link is not None else ())


def open_tracer(cfg: Any) -> RunTracer | None:
    """The run's tracer (None with telemetry.traces=off: nothing is imported)."""
    if cfg.telemetry.traces == "off":
        return None
    return RunTracer(cfg.telemetry, cfg.run.dir, cfg.run.name)
