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
them to one background thread, which makes the spans (with their recorded times) and passes them to the
SDK's BatchSpanProcessor; the step's own thread does no more than copy references. Off, this module is
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
    """A span exporter writing OTLP JSON lines (the SDK's SpanExporter protocol)."""

    def __init__(self, path: Path):
        self.path = path
        self._file = path.open("a")

    def export(self, sdk_spans) -> Any:
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export import SpanExportResult

        message = MessageToDict(encode_spans(sdk_spans))
        for resource in message.get("resourceSpans", []):
            for scope in resource.get("scopeSpans", []):
                for span in scope.get("spans", []):
                    _hex_ids(span)
                    for link in span.get("links", []):
                        _hex_ids(link)
        self._file.write(json.dumps(message, separators=(",", ":")) + "\n")
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, *_: Any) -> bool:
        self._file.flush()
        return True


def _hex_ids(obj: dict) -> None:
    """OTLP JSON carries ids as hex; protobuf's JSON mapping gives base64."""
    import base64

    for key in ("traceId", "spanId", "parentSpanId"):
        if obj.get(key):
            obj[key] = base64.b64decode(obj[key]).hex()


class _Ids:
    """Span and step trace ids from a generator of its own (never the global `random`: the run's draws are
    the same with tracing on or off); an episode's trace id is the one asked for (`next_trace_id`)."""

    def __init__(self):
        import os
        import random

        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.next_trace_id: int | None = None

    def generate_span_id(self) -> int:
        return self._rng.getrandbits(64) or 1

    def is_trace_id_random(self) -> bool:
        return False                     # episode traces take the ledger's id

    def generate_trace_id(self) -> int:
        out, self.next_trace_id = self.next_trace_id, None
        return out if out is not None else self._rng.getrandbits(128) or 1


class RunTracer:
    """Spans of the run's steps and episodes, made on a background thread from snapshots."""

    def __init__(self, cfg: Any, run_dir: str | Path, run_name: str):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.share = cfg.trace_sample
        if cfg.traces == "file":
            self.path: Path | None = Path(run_dir) / TRACE_FILE
            exporter: Any = OtlpJsonFile(self.path)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.path, exporter = None, OTLPSpanExporter(endpoint=cfg.trace_endpoint or None)
        self._ids = _Ids()
        self.provider = TracerProvider(resource=Resource.create({"service.name": "hybridrl", "hybridrl.run": run_name}),
                                       id_generator=self._ids, shutdown_on_exit=False)
        # a step of a large run makes thousands of spans at once: a queue that holds them, exported in big batches
        self.provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=1 << 17,
                                                            max_export_batch_size=8192))
        self.tracer = self.provider.get_tracer("hybridrl")
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
        self.provider.shutdown()

    # on the background thread
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, current, metrics, episodes = item
            try:
                link, train = self._step_trace(step, current, metrics)
                for episode in episodes:
                    self._episode_trace(step, episode, link, train)
            except Exception:  # noqa: BLE001 - tracing must never cost the run
                log.warning("tracing step %d failed; its spans are incomplete", step, exc_info=True)

    def _step_trace(self, step: int, current, metrics: dict):
        """The step's trace; returns its root's context (for links) and its train stage (start, end)."""
        from opentelemetry import trace

        if current is None or current[0] != step:
            return None, None
        _, start, stages = current
        end = max([start] + [e for _, _, e in stages])
        root = self.tracer.start_span(f"step {step}", start_time=_ns(start), attributes={
            "hybridrl.step": step, **_attributes({k.replace("/", "."): v for k, v in metrics.items()
                                                  if k in ("reward/mean", "loss", "policy/version", "episodes")})})
        context = trace.set_span_in_context(root)
        train = None
        for name, s, e in stages:
            if name in _STEP_STAGES:
                self.tracer.start_span(name, context=context, start_time=_ns(s)).end(end_time=_ns(e))
                if name == "train":
                    train = (s, e)
        root.end(end_time=_ns(end))
        return root.get_span_context(), train

    def _episode_trace(self, step: int, episode: tuple, link, train) -> None:
        from opentelemetry import trace

        tid, ledger_trace, events, timings, reward, status, consumed, engine = episode
        found = [s for s in spans.episode_spans(events, timings) if s[0] != "queued"]   # an attribute here
        if not found:
            return
        self._ids.next_trace_id = otel_trace_id(ledger_trace)
        made: list[Any] = []
        nested = spans.nest(found)
        for name, start, end, args, _, parent in nested:
            attributes = _attributes(args)
            if parent < 0:
                attributes.update({"hybridrl.trajectory_id": tid, "hybridrl.trace_id": ledger_trace,
                                   "hybridrl.step": step, "hybridrl.reward": float(reward), "hybridrl.status": status})
                if engine is not None:
                    attributes["hybridrl.engine_rank"] = int(engine)
            context = trace.set_span_in_context(made[parent]) if parent >= 0 else None
            span = self.tracer.start_span(name, context=context, start_time=_ns(start), attributes=attributes)
            made.append(span)
        if consumed and train is not None:
            links = [trace.Link(link)] if link is not None else []
            self.tracer.start_span("update", context=trace.set_span_in_context(made[0]), start_time=_ns(train[0]),
                                   attributes={"hybridrl.update_step": step}, links=links).end(end_time=_ns(train[1]))
        for span, (_, _, end, _, _, _) in reversed(list(zip(made, nested))):
            span.end(end_time=_ns(end))


def open_tracer(cfg: Any) -> RunTracer | None:
    """The run's tracer (None with telemetry.traces=off: nothing is imported)."""
    if cfg.telemetry.traces == "off":
        return None
    return RunTracer(cfg.telemetry, cfg.run.dir, cfg.run.name)
