"""Observability of a real run (2 CPU ranks, the tiny recipe), one run shared by every check: the
Prometheus port scraped while it lives, the timeline of its ranks and engines (`inspect --timeline`),
and its OpenTelemetry traces (telemetry.traces=file) against its ledger; and the traces of the real agent
loop's tool calls (a scripted engine, tests/inspect/test_trace.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.inspect.test_timeline import check_trace
from tests.launch import ROOT, env_with_repo, free_port

RECIPE = ROOT / "tests" / "controller" / "rl_tiny.yaml"
STEPS = 4


def scrape(port: int) -> dict[str, float]:
    """One scrape of the metrics port: sample name (with labels) -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory, tiny_models):
    """The run, and every scrape that reached its port while it ran."""
    model = tiny_models("qwen2", init_std=0.05)
    run_dir = tmp_path_factory.mktemp("observed")
    port = free_port()
    cmd = [sys.executable, "-m", "hybridrl", "train", str(RECIPE), f"model.path={model}", f"run.dir={run_dir}",
           f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=2", "trainer.export_hf=false",
           f"trainer.metrics_port={port}", "telemetry.traces=off", "telemetry.traces=file"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    scrapes: list[dict[str, float]] = []

    def poll():
        while proc.poll() is None:
            try:
                scrapes.append(scrape(port))
            except OSError:                   # not serving yet, or no more
                time.sleep(0.005)

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    out, err = proc.communicate(timeout=600)
    watcher.join(timeout=10)
    assert proc.returncode == 0, err[-4000:]
    return run_dir, scrapes


def test_the_metrics_port_serves_the_advancing_step_while_the_run_lives(observed_run):
    run_dir, scrapes = observed_run
    steps = [s["hybridrl_step"] for s in scrapes]
    assert len(set(steps)) >= 2, f"the step never advanced in {len(scrapes)} scrapes: {sorted(set(steps))}"
    assert steps == sorted(steps) and max(steps) <= STEPS
    counted = [s["hybridrl_steps_total"] for s in scrapes]
    assert counted == sorted(counted) and len(set(counted)) >= 2
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for s in scrapes:                          # each scrape's scalars are its step's row in metrics.jsonl
        step = int(s["hybridrl_step"])
        if step > 0 and "hybridrl_reward_mean" in s:
            assert s["hybridrl_reward_mean"] == pytest.approx(rows[step]["reward/mean"])
            assert s["hybridrl_tokens_generated"] == rows[step]["tokens/generated"]
        phases = {k for k, v in s.items() if k.startswith("hybridrl_phase{") and v == 1.0}
        assert len(phases) == 1, phases         # one stage at a time
    seen = {k for s in scrapes for k, v in s.items() if k.startswith("hybridrl_phase{") and v == 1.0}
    assert len(seen) >= 2, seen


def test_the_timeline_has_every_rank_and_engine_and_its_steps(observed_run):
    run_dir, _ = observed_run
    proc = subprocess.run([sys.executable, "-m", "hybridrl", "inspect", str(run_dir), "--timeline"], cwd=ROOT,
                          env=env_with_repo(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((run_dir / "timeline.json").read_text())
    threads = check_trace(trace)
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["engine 0 (episodes)", "engine 1 (episodes)", "rank 0", "rank 1"]
    controller = [e for e in threads[(0, 1)]]
    steps = [e for e in controller if e["name"] == "step"]
    assert [e["args"]["step"] for e in steps] == list(range(1, STEPS + 1))
    names = {e["name"] for e in controller}
    assert {"sync", "rollout", "prep", "train", "store", "validate", "checkpoint"} <= names
    assert sum(e["name"] == "checkpoint" for e in controller) == 2          # steps 2 and 4
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    for step in steps:                         # the controller's stages inside a step add up to its metrics
        inside = [e for e in controller if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        train = sum(e["dur"] for e in inside if e["name"] == "train") / 1e6
        assert train == pytest.approx(rows[step["args"]["step"]]["time/T_train"], rel=0.05, abs=2e-3)
    for rank in (0, 1):                         # every rank: its switch phases, generation and train passes
        phases = {e["name"] for e in threads[(rank, 2)]}
        assert {"offload", "wake", "generate", "sleep", "reload", "train"} <= phases, phases
    episodes = [e for (pid, _), es in threads.items() if pid >= 1000 for e in es if e["name"] == "episode"]
    assert len(episodes) == sum(r["episodes"] for s, r in rows.items() if s > 0)
    assert (run_dir / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def otlp_spans(path) -> list[dict]:
    """Every span of an OTLP JSON lines file, attributes as a dict."""
    out = []
    for line in path.read_text().splitlines():
        for resource in json.loads(line)["resourceSpans"]:
            for scope in resource["scopeSpans"]:
                for span in scope["spans"]:
                    attrs = {a["key"]: _value(a["value"]) for a in span.get("attributes", [])}
                    out.append({**span, "attributes": attrs})
    return out


def _value(v: dict):
    """An OTLP JSON attribute value (64-bit integers travel as strings)."""
    (kind, value), = v.items()
    return int(value) if kind == "intValue" else value


def spans_of_trace(spans: list[dict], trace_id: str) -> dict[str, list[dict]]:
    by_name: dict[str, list[dict]] = {}
    for s in spans:
        if s["traceId"] == trace_id:
            by_name.setdefault(s["name"].split(" ")[0].split(":")[0], []).append(s)
    return by_name


def test_one_trace_per_episode_covers_its_turns_reward_and_update_with_the_ledgers_ids(observed_run):
    from hybridrl.inspect.query import RunLedger

    run_dir, _ = observed_run
    spans = otlp_spans(run_dir / "traces.otlp.jsonl")
    ids = {s["spanId"] for s in spans}
    assert all(len(s["traceId"]) == 32 and len(s["spanId"]) == 16 for s in spans)
    assert all(s.get("parentSpanId", "") in ids | {""} for s in spans)      # every parent was exported
    steps = {s["attributes"]["hybridrl.step"]: s for s in spans if s["name"].startswith("step ")}
    assert sorted(steps) == list(range(1, STEPS + 1))
    ledger = RunLedger(run_dir)
    episodes = ledger.select()
    assert sum(s["name"] == "episode" for s in spans) == len(episodes)         # trace_sample 1: every one
    for row in (episodes[0], episodes[-1]):
        answer = ledger.explain(row["id"])
        mine = spans_of_trace(spans, "0" * 16 + answer["trace_id"])
        (root,) = mine["episode"]
        assert root["attributes"]["hybridrl.trajectory_id"] == row["id"]
        assert root["attributes"]["hybridrl.step"] == row["step"]
        assert len(mine["turn"]) == len(answer["timings"]["turns"])
        assert len(mine["generate"]) == len(answer["policy"]["requests"])
        assert len(mine.get("tool", [])) == len(answer["environment"]["side_effects"])
        assert len(mine["reward"]) == 1 and mine["reward"][0]["attributes"]["hybridrl.total"] == row["reward"]
        (update,) = mine["update"]
        assert update["attributes"]["hybridrl.update_step"] == answer["update"]["step"]
        step = steps[answer["update"]["step"]]
        assert update["links"][0]["traceId"] == step["traceId"]
        train = next(s for s in spans if s["traceId"] == step["traceId"] and s["name"] == "train")
        assert (update["startTimeUnixNano"], update["endTimeUnixNano"]) == (train["startTimeUnixNano"],
                                                                           train["endTimeUnixNano"])
        for s in [x for group in mine.values() for x in group]:
            assert int(s["startTimeUnixNano"]) <= int(s["endTimeUnixNano"])


@pytest.fixture(scope="module")
def scripted_episodes(tmp_path_factory, tiny_models):
    """The real agent loop's episodes on a scripted engine (one calls the calculator)."""
    from transformers import AutoTokenizer

    from tests.inspect.test_trace import run_step

    _, _, trajs, _ = run_step(tmp_path_factory.mktemp("scripted"), AutoTokenizer.from_pretrained(tiny_models("qwen2")))
    return trajs


def test_the_tracer_traces_tool_calls_and_samples_by_trajectory_id(tmp_path, scripted_episodes):
    from types import SimpleNamespace

    from hybridrl.telemetry.otel import RunTracer, sampled

    trajs = scripted_episodes
    tracer = RunTracer(SimpleNamespace(traces="file", trace_endpoint="", trace_sample=1.0), tmp_path, "t")
    tracer.step(1, {}, trajs)
    tracer.close()
    spans = otlp_spans(tmp_path / "traces.otlp.jsonl")
    right = trajs[0]                            # the calculator episode: its 4th turn ran the calculator
    mine = spans_of_trace(spans, "0" * 16 + right.trace_id)
    (tool,) = mine["tool"]
    assert tool["name"] == "tool:calculator" and tool["attributes"]["hybridrl.turn"] == 3
    turn3 = next(s for s in mine["turn"] if s["name"] == "turn 3")
    assert tool["parentSpanId"] == turn3["spanId"]
    assert len(mine["prefill"]) == len(mine["decode"]) == len(mine["generate"]) and "queued" not in mine
    assert all("hybridrl.queued_s" in g["attributes"] for g in mine["generate"])
    assert "update" not in mine                 # no update ran in this test
    ids = [f"run/task/g/{i}" for i in range(2000)]
    share = sum(sampled(i, 0.25) for i in ids) / len(ids)
    assert 0.2 < share < 0.3 and [sampled(i, 0.25) for i in ids] == [sampled(i, 0.25) for i in ids]


def test_incidents_and_the_phase_are_served_as_counted():
    from hybridrl.telemetry import live

    served = live.LiveMetrics("127.0.0.1", 0)
    before = {m.name: m for m in served.collect()}["hybridrl_incidents"]
    was = {s.labels["kind"]: s.value for s in before.samples if s.name.endswith("_total")}.get("nan_loss", 0.0)
    live.count_incident("nan_loss")
    live.count_incident("nan_loss")
    previous = live.set_phase("rollout")
    try:
        served.on_step(3, {"reward/mean": 0.5, "loss": float("nan"), "flag": True})
        families = {m.name: m for m in served.collect()}
    finally:
        live.set_phase(previous)
    counted = {s.labels["kind"]: s.value for s in families["hybridrl_incidents"].samples if s.name.endswith("_total")}
    assert counted["nan_loss"] == was + 2
    assert [s.labels["phase"] for s in families["hybridrl_phase"].samples if s.value == 1.0] == ["rollout"]
    assert families["hybridrl_reward_mean"].samples[0].value == 0.5
    assert "hybridrl_loss" not in families and "hybridrl_flag" not in families     # NaN and booleans: not scalars
    assert families["hybridrl_step"].samples[0].value == 3


def test_traces_reach_an_otlp_endpoint(tmp_path, scripted_episodes):
    """telemetry.traces=otlp: the SDK's OTLP/HTTP exporter posts protobuf to the endpoint (a local one here)."""
    import http.server
    from types import SimpleNamespace

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from hybridrl.telemetry.otel import RunTracer

    bodies: list[bytes] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        trajs = scripted_episodes
        endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
        tracer = RunTracer(SimpleNamespace(traces="otlp", trace_endpoint=endpoint, trace_sample=1.0), tmp_path, "t")
        tracer.step(1, {}, trajs)
        tracer.close()
    finally:
        server.shutdown()
    trace_ids = set()
    for body in bodies:
        request = ExportTraceServiceRequest.FromString(body)
        trace_ids |= {s.trace_id.hex() for r in request.resource_spans for sc in r.scope_spans for s in sc.spans
                      if s.name == "episode"}
    assert trace_ids == {"0" * 16 + t.trace_id for t in trajs}


def test_the_trace_files_json_is_what_the_sdks_otlp_encoder_makes():
    """The file exporter's own OTLP JSON against the SDK's protobuf encoder + protobuf's JSON mapping (ids as
    hex): parents, links, events, every attribute type, an error status, two scopes, a remote parent."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.common")
    import base64

    from google.protobuf.json_format import MessageToDict
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

    from hybridrl.telemetry.otel import otlp_json

    class Keep(SpanExporter):
        spans: list = []

        def export(self, spans):
            self.spans.extend(spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"service.name": "hybridrl", "hybridrl.run": "r"}))
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer, other = provider.get_tracer("hybridrl"), provider.get_tracer("other", "1.2")
    root = tracer.start_span("episode", start_time=10, attributes={
        "s": "x", "i": 2 ** 40, "f": 0.25, "b": True, "ls": ["a", "b"], "li": [1, 2], "lf": [0.5], "lb": [False]})
    child = tracer.start_span("turn 0", context=trace.set_span_in_context(root), start_time=11)
    child.add_event("token", {"n": 3}, timestamp=12)
    child.set_status(Status(StatusCode.ERROR, "it failed"))
    child.end(end_time=13)
    linked = other.start_span("update", start_time=14, links=[trace.Link(root.get_span_context(), {"why": "trained"})])
    linked.set_status(Status(StatusCode.OK))
    linked.end(end_time=15)
    remote = SpanContext(trace_id=7, span_id=9, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    tracer.start_span("from afar", context=trace.set_span_in_context(trace.NonRecordingSpan(remote)),
                      start_time=16).end(end_time=17)
    root.end(end_time=18)

    want = MessageToDict(encode_spans(Keep.spans))
    for resource in want["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for ids in [span, *span.get("links", [])]:
                    for key in ("traceId", "spanId", "parentSpanId"):
                        if key in ids:
                            ids[key] = base64.b64decode(ids[key]).hex()
    assert len(Keep.spans) == 4 and otlp_json(Keep.spans) == want
