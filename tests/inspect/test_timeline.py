"""`hybridrl inspect RUN --timeline`: the trace's schema, its episodes against the ledger's own events, the
step filter, and the page's picture (rendered in headless Chromium where it is installed). The ranks'
spans of a real run are checked in tests/test_observability.py; here the episodes are the real agent
loop's (a scripted engine, tests/inspect/test_trace.py) and the ranks' spans are written by hand."""

from __future__ import annotations

import json
import re

import pytest

from hybridrl.inspect.timeline import ENGINE_PID, build_trace, parse_steps
from hybridrl.telemetry.spans import SpanLog, nest, timeline_dir


def check_trace(trace: dict) -> dict[tuple[int, int], list[dict]]:
    """Every event has ph / ts / pid / tid; spans have a nonnegative duration and nest on their thread;
    every thread and process is named. Returns the spans by thread."""
    events = trace["traceEvents"]
    json.dumps(trace)                               # plain JSON
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    procs = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads: dict[tuple[int, int], list[dict]] = {}
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
            assert (e["pid"], e["tid"]) in named and e["pid"] in procs, e
            threads.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in threads.values():
        open_ends: list[float] = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"] + 1e-6:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1] + 1e-6, ("straddles its parent", e)
            open_ends.append(e["ts"] + e["dur"])
    return threads


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_models):
    """A ledger of the real agent loop's episodes, and two steps of rank spans around them."""
    from transformers import AutoTokenizer

    from tests.inspect.test_trace import run_step

    tmp = tmp_path_factory.mktemp("timeline")
    _, _, trajs, _ = run_step(tmp, AutoTokenizer.from_pretrained(tiny_models("qwen2")))
    events = [e for t in trajs for e in t.metadata.get("trace", [])]
    first = min(e["at"] for e in events) - 1.0
    last = max(e["at"] for e in events)
    log = SpanLog(timeline_dir(tmp) / "rank0-1.jsonl", 0)
    log.record("step", first - 2.0, first, track="controller", step=1)
    log.record("sync", first - 1.9, first - 1.5, track="controller")
    log.record("step", first, last + 1.0, track="controller", step=2)
    log.record("rollout", first + 0.1, last, track="controller")
    log.record("wait:offload", first + 0.01, first + 0.02, track="phases")
    log.record("generate", first + 0.2, last + 0.001, track="phases")
    log.close()
    return tmp, trajs


def test_the_trace_loads_and_its_episodes_are_the_ledgers(run_dir):
    tmp, trajs = run_dir
    trace = build_trace(tmp)
    threads = check_trace(trace)
    assert {t for t in threads if t[0] < ENGINE_PID} == {(0, 1), (0, 2)}      # rank 0: controller, phases
    spans = [e for (pid, _), es in threads.items() if pid >= ENGINE_PID for e in es]
    episodes = {e["args"]["trajectory"]: e for e in spans if e["name"] == "episode"}
    assert set(episodes) == {t.trajectory_id for t in trajs}
    right = trajs[0]                                # the calculator episode: 5 turns, the 4th ran a tool
    ep = episodes[right.trajectory_id]
    mine = [e for e in spans if (e["pid"], e["tid"]) == (ep["pid"], ep["tid"]) and ep["ts"] <= e["ts"]
            and e["ts"] + e["dur"] <= ep["ts"] + ep["dur"] + 1e-6]
    assert sorted(e["name"] for e in mine if e["name"].startswith("turn ")) == [f"turn {i}" for i in range(5)]
    tools = [e for e in mine if e["cat"] == "tool"]
    assert [(e["name"], e["args"]["turn"]) for e in tools] == [("tool:calculator", 3)]
    latency = next(c.latency_s for c in right.tool_calls if c.name == "calculator" and c.ok)
    assert tools[0]["dur"] == pytest.approx(latency * 1e6, abs=1.0)
    requests = [e for e in mine if e["name"] == "generate"]
    totals = [g["total_s"] for g in right.metadata["trace"] if g["span"] == "generate"]
    assert [e["dur"] for e in requests] == pytest.approx([1e6 * s for s in totals], abs=1.0)
    assert sum(e["name"] == "reward" for e in mine) == 1
    # two episodes that overlap in time never share a lane
    lanes: dict[tuple, list] = {}
    for e in episodes.values():
        lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans_ in lanes.values():
        spans_.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans_, spans_[1:]))


def test_steps_select_a_window_and_bad_ones_are_named(run_dir, capsys):
    from tests.inspect.test_trace import _args
    from hybridrl.inspect.cli import main

    tmp, _ = run_dir
    names = {e["name"] for e in build_trace(tmp, (2, 2))["traceEvents"] if e["ph"] == "X"}
    assert "rollout" in names and "sync" not in names                  # the sync span is step 1's
    assert "sync" in {e["name"] for e in build_trace(tmp, (1, 1))["traceEvents"] if e["ph"] == "X"}
    assert parse_steps("3") == (3, 3) and parse_steps("2-5") == (2, 5)
    for bad in ("5-2", "a-b"):
        with pytest.raises(ValueError, match="--steps"):
            parse_steps(bad)
    assert main(_args(tmp, timeline=True, steps="7-9")) == 2
    assert "steps [7, 8, 9] are not in the run's timeline" in capsys.readouterr().err
    out = tmp / "t" / "trace.json"
    assert main(_args(tmp, timeline=True, steps="1-2", out=out)) == 0
    check_trace(json.loads(out.read_text()))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_span_straddling_its_parent_is_cut_at_its_end():
    nested = nest([("a", 0.0, 1.0, {}), ("b", 0.5, 1.5, {}), ("c", 2.0, 3.0, {}), ("d", 0.1, 0.2, {})])
    assert [(n, s, e, depth, parent) for n, s, e, _, depth, parent in nested] == [
        ("a", 0.0, 1.0, 0, -1), ("d", 0.1, 0.2, 1, 0), ("b", 0.5, 1.0, 1, 0), ("c", 2.0, 3.0, 0, -1)]
    assert nested[2][3] == {"cut_at_parent_end": True}


def test_the_page_shows_the_timeline_picture(run_dir):
    from hybridrl.inspect.html import write_html
    from hybridrl.inspect.query import RunLedger
    from tests.inspect.ledger_checks import chromium, render

    tmp, trajs = run_dir
    page = write_html(RunLedger(tmp), tmp / "page.html", [trajs[0].trajectory_id])
    blob = json.loads(re.search(r'id="ledger-data">(.*?)</script>', page.read_text(), re.S).group(1))
    png = blob["timeline"]
    import base64

    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    if chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium); the page was written, not rendered")
    dom = render(page.as_uri(), "--dump-dom").stdout.decode("utf-8", "replace")
    width = re.search(r'<img id="timeline-png"[^>]*data-width="(\d+)"', dom)
    assert width is not None and int(width.group(1)) > 500
