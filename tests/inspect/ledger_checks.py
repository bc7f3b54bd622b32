"""Checks of a finished RL run's ledger against what the run itself logged (metrics.jsonl, samples.jsonl,
config.json), and of its HTML page as headless Chromium renders it. Used on the demo's miniature
(tests/test_demo.py), whose run this file does not repeat."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from hybridrl.telemetry.metrics import read_metrics
from tests.launch import ROOT, env_with_repo

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(url: str, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium on `url` with a fresh profile (its stdout: --dump-dom's DOM after the scripts ran)."""
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra, url],
                              capture_output=True, timeout=timeout)


def inspect(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl", "inspect", str(run_dir), *args], cwd=ROOT,
                          env=env_with_repo(), capture_output=True, text=True, timeout=300)


def check_ledger_answers(run_dir: Path) -> list[dict]:
    """Every trajectory's eight answers against the run's own logs; returns the answers."""
    from hybridrl.inspect.query import RunLedger
    from transformers import AutoTokenizer

    config = json.loads((run_dir / "config.json").read_text())
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    proc = inspect(run_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["steps"] == len(rows)
    assert summary["trajectories"] == sum(r["episodes"] for r in rows)
    assert summary["consumed"] == sum(r["episodes/admitted"] for r in rows)
    statuses: Counter = Counter()
    for r in rows:
        statuses.update({k[len("status/"):]: int(v) for k, v in r.items() if k.startswith("status/") and v})
    assert summary["statuses"] == dict(statuses)
    assert summary["bytes"]["per_trajectory"] > 0
    samples = {s["trajectory_id"]: s for s in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())}
    tokenizer = AutoTokenizer.from_pretrained(config["model"]["path"])
    ledger = RunLedger(run_dir)
    answers = []
    for r in rows:
        step = r["step"]
        listed = json.loads(inspect(run_dir, "--step", str(step), "--json", "--limit", "1000").stdout)
        ids = [t["id"] for t in listed["trajectories"]] if "trajectories" in listed else [listed["id"]]
        found = [ledger.explain(i) for i in ids]
        answers += found
        policy_tokens = sum(sum(e["tokens"]["mask"]) for e in found)
        assert policy_tokens == r["tokens/generated"]
        # 1. every token from the policy the step rolled out with, sampled as configured
        assert all(set(e["policy"]["by_version"]) <= {r["policy/version"] - 1, r["policy/version"]} for e in found)
        assert all(q["temperature"] == config["agent"]["temperature"] for e in found for q in e["policy"]["requests"])
        assert sum(len(e["policy"]["requests"]) for e in found) >= len(found)
        # 2. the turns' times add up to the episode's
        for e in found:
            assert sum(t["generate_s"] for t in e["timings"]["turns"]) <= e["timings"]["episode"]["generate_s"] + 1e-6
            assert len(e["timings"]["turns"]) == max(1, max((t["turn"] + 1 for t in e["timings"]["turns"]), default=1))
        # 3 / 4. what the parser, the authorizer and the tools did is what the agent counted
        refused = Counter(d["decision"] for e in found for a in e["actions"] for d in a["decisions"])
        assert sum(len(e["environment"]["side_effects"]) for e in found) == r.get("agent/tool_calls", 0)
        assert refused["malformed"] == r.get("agent/malformed_actions", 0)
        assert refused["unauthorized"] == r.get("agent/unauthorized_actions", 0)
        assert refused["invalid_arguments"] == r.get("agent/invalid_arguments", 0)
        assert sum(1 for e in found for s in e["environment"]["side_effects"] if not s["ok"]) == r.get("agent/tool_errors", 0)
        # 5. rewards: the logged mean, each component with its evaluator
        assert sum(e["reward"]["total"] for e in found) / len(found) == pytest.approx(r["reward/mean"])
        assert all(c["evaluator"] for e in found for c in e["reward"]["components"].values())
        # 6. GRPO advantages recomputed from the recorded group rewards
        for e in found:
            a = e["advantage"]
            if a.get("computed") is False:
                continue
            std = a["group_std"]
            want = 0.0 if a["group_size"] < 2 or std == 0 else (a["reward"] - a["group_mean"]) / (std + 1e-6)
            assert a["value"] == pytest.approx(want, abs=1e-5)
            assert a["value"] == pytest.approx(next(x for x, m in zip(e["tokens"]["advantages"], e["tokens"]["mask"])
                                                    if m), abs=1e-6)
        # 7. what the update consumed is what the step logged as admitted
        consumed = [e for e in found if e["update"]["consumed"]]
        assert len(consumed) == r["episodes/admitted"]
        assert sum(e["update"]["tokens_trained"] for e in consumed) == r["tokens/admitted"]
        assert all(e["update"]["policy_version_after"] == r["policy/version"] for e in consumed)
        # 8. the release of the updated policy (published by the next rollout or validation)
        for e in consumed:
            rel = e["checkpoint"]["release"]
            assert rel is not None and rel["checkpoint_hash"].startswith("xxh3_128:")
        # the tokens are the ones the run decoded into samples.jsonl
        for e in found:
            if e["id"] in samples:
                s = samples[e["id"]]
                assert tokenizer.decode(e["tokens"]["prompt_ids"] + e["tokens"]["response_ids"]) == s["text"]
                assert e["reward"]["total"] == s["reward"] and e["status"] == s["status"]
    return answers


def check_html_page(run_dir: Path, out: Path, answers: list[dict]) -> None:
    """The page renders in headless Chromium: curves, stage bars, every rendered episode's tokens annotated."""
    proc = inspect(run_dir, "--html", str(out), "--episodes", "4")
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    if chromium() is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium); the page was written, not rendered")
    dom = render(out.as_uri(), "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout.decode("utf-8", "replace")
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    vals = [r for r in read_metrics(run_dir) if r.get("val/accuracy") is not None]
    import re

    lines = {m.group(1): m.group(2) for m in re.finditer(r'<polyline class="series" data-name="([^"]+)"[^>]*points="([^"]*)"', html)}
    assert len(lines["reward/mean"].split()) == len(rows) and len(lines["val/accuracy"].split()) == len(vals)
    assert len(re.findall(r'<rect class="stage"', html)) == 6 * len(rows)
    shown = re.findall(r'<div class="episode" data-id="([^"]+)"', html)
    assert 1 <= len(shown) <= 4
    by_id = {e["id"]: e for e in answers}
    tokens = re.findall(r'<span class="tok"[^>]*data-version="(\d+)" data-logprob="([-0-9.]+)"[^>]*title="([^"]*)"', html)
    assert len(tokens) == sum(sum(by_id[i]["tokens"]["mask"]) for i in shown) > 0
    first = by_id[shown[0]]
    policy = [(v, lp) for v, lp, m in zip(first["tokens"]["versions"], first["tokens"]["behavior_logprobs"],
                                          first["tokens"]["mask"]) if m]
    assert [(int(v), float(lp)) for v, lp, _ in tokens[:len(policy)]] == [(v, pytest.approx(lp, abs=1e-4))
                                                                         for v, lp in policy]
    assert all("logprob" in title and "policy v" in title for _, _, title in tokens)
    shot = out.with_suffix(".png")
    render(out.as_uri(), f"--screenshot={shot}", "--window-size=1200,1600")
    assert shot.exists() and shot.stat().st_size > 10_000
