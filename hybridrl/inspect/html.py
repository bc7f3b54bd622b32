"""`hybridrl inspect RUN_DIR --html OUT.html`: one self-contained page (no network needed to view it).

The page embeds its data as JSON and draws everything with inline JavaScript and SVG:
  - reward and validation-accuracy curves per step (metrics.jsonl),
  - stage times per step as stacked bars (rollout, sync, prep, train, store, the rest),
  - the timeline (`inspect/timeline.py`): what each rank and engine did over the steps, as a picture,
  - per step: policy lag, trajectories not trained on and why (filter reasons), statuses,
  - the run's cost (`hybridrl cost`): device-seconds by stage family and stage, never-trained work by
    reason, money,
  - episodes turn by turn: every token coloured by the policy version that produced it (observation
    tokens grey), its behaviour logprob as the colour's strength, and a hover title with the token,
    its version, behaviour / trainer logprob and advantage; tool calls with the authorizer's
    decision, environment steps, reward components with their evaluators, and the eight answers.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from hybridrl.inspect.query import RunLedger

_STAGES = ("rollout", "sync", "prep", "train", "store")


def page_data(ledger: RunLedger, ids: list[str]) -> dict:
    from hybridrl.telemetry.metrics import read_metrics

    rows = read_metrics(ledger.run_dir) if (ledger.run_dir / "metrics.jsonl").exists() else []
    curves = {"reward": [[r["step"], r["reward/mean"]] for r in rows if r.get("reward/mean") is not None],
              "accuracy": [[r["step"], r["reward/accuracy"]] for r in rows if r.get("reward/accuracy") is not None],
              "validation": [[r["step"], r["val/accuracy"]] for r in rows if r.get("val/accuracy") is not None]}
    stages = []
    for r in rows:
        if r["step"] <= 0 or r.get("time/step_s") is None:
            continue
        parts = {s: float(r.get(f"time/T_{s}") or 0.0) for s in _STAGES}
        parts["other"] = max(0.0, float(r["time/step_s"]) + parts["store"] - sum(parts.values()))
        stages.append({"step": r["step"], **parts})
    steps = []
    for s in ledger.steps():
        filters = {k: v for k, v in json.loads(s["filters"] or "{}").items() if v}
        lag = max((t["lag"] for t in ledger.select(step=s["step"])), default=0)
        statuses: dict[str, int] = {}
        for t in ledger.select(step=s["step"]):
            statuses[t["status"]] = statuses.get(t["status"], 0) + 1
        steps.append({"step": s["step"], "episodes": s["episodes"], "admitted": s["admitted"], "lag_max": lag,
                      "filters": filters, "statuses": statuses, "version": [s["rollout_version"], s["version_after"]],
                      "store_s": s["write_s"], "pruned": bool(s["pruned"])})
    return {"summary": ledger.summary(), "curves": curves, "evaluations": evaluation_series(ledger), "stages": stages,
            "steps": steps,
            "episodes": [ledger.explain(i) for i in ids], "cost": cost_data(ledger.run_dir),
            "timeline": timeline_png(ledger.run_dir)}


def timeline_png(run_dir: Path) -> str | None:
    """The run's timeline as a base64 PNG for the page (None for a run without one, or without matplotlib)."""
    import base64
    import tempfile

    from hybridrl.inspect.timeline import build_trace, has_matplotlib
    from hybridrl.inspect.timeline_plot import draw
    from hybridrl.telemetry.spans import timeline_dir

    if not has_matplotlib() or not any(timeline_dir(run_dir).glob("rank*.jsonl")):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        png = draw(build_trace(run_dir), Path(tmp) / "timeline.png", title="what each rank and engine did")
        return base64.b64encode(png.read_bytes()).decode()


def evaluation_series(ledger: RunLedger) -> list[dict]:
    """The suites' results across the run's checkpoints (`hybridrl eval SUITE --run`, in-loop evaluation):
    one series per suite, sampling and metric (accuracy, and pass@k for the largest k), points by step."""
    series: dict[str, list[list[float]]] = {}
    for row in ledger.evaluations():
        for sampling, values in row["metrics"].get("sampling", {}).items():
            ks = sorted((int(k[5:]) for k in values if k.startswith("pass@") and k[5:].isdigit()), reverse=True)
            for metric in ["accuracy"] + [f"pass@{k}" for k in ks[:1] if k > 1]:
                if values.get(metric) is not None:
                    series.setdefault(f"{row['suite']} {sampling} {metric}", []).append([row["step"], values[metric]])
    return [{"name": name, "points": sorted(points)} for name, points in series.items()]


def cost_data(run_dir: Path) -> dict | None:
    """The run's books for the page's cost section (hybridrl/cost): None where they cannot be made."""
    try:
        from hybridrl.cost.accounting import account
        from hybridrl.cost.prices import load_prices
        from hybridrl.cost.report import run_report

        r = run_report(account(run_dir), load_prices())
    except Exception as err:        # the page still renders without the books
        return {"error": f"{type(err).__name__}: {err}"}
    keys = ("wall_s", "world_size", "roles", "device_s_total", "device_s_expected", "by_stage", "by_family",
            "never_trained", "tokens", "episodes", "environment", "stored_bytes", "notes")
    return {**{k: r[k] for k in keys}, "money": {k: v for k, v in r["money"].items() if k != "by_stage"}}


def write_html(ledger: RunLedger, out: str | Path, ids: list[str]) -> Path:
    data = page_data(ledger, ids)
    blob = json.dumps(data, default=str).replace("</", "<\\/")     # never closes the script element
    title = html.escape(f"hybridrl run {ledger.run_dir.name}")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_PAGE.replace("__TITLE__", title).replace("__DATA__", blob))
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1200px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
.charts{display:flex;flex-wrap:wrap;gap:1.5em}.chart{border:1px solid #ddd;padding:.4em}
table{border-collapse:collapse;margin:.4em 0}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left;font-size:13px}
.episode{border:1px solid #bbb;border-radius:4px;padding:.6em;margin:1em 0}
.tokens{font-family:ui-monospace,monospace;font-size:13px;white-space:pre-wrap;word-break:break-all;line-height:1.9}
.tok{border-radius:2px;padding:1px 0;cursor:help}.obs{background:#e4e4e4;color:#555}.prompt{color:#666}
.legend span{display:inline-block;padding:0 6px;margin-right:4px;border-radius:2px}
.turn{margin:.5em 0;padding-left:.6em;border-left:3px solid #8ab}
.bad{color:#b00}.ok{color:#070}details pre{font-size:12px;max-height:30em;overflow:auto;background:#f6f6f6}
</style></head>
<body>
<h1>__TITLE__</h1>
<div id="summary"></div>
<h2>Curves</h2><div class="charts" id="curves"></div>
<h2>Stage times per step</h2><div class="charts" id="stages"></div>
<h2>Timeline</h2><div id="timeline"></div>
<h2>Lag and filter reasons</h2><div id="steps"></div>
<h2>Cost</h2><div id="cost"></div>
<h2>Episodes</h2><div class="legend" id="legend"></div><div id="episodes"></div>
<script type="application/json" id="ledger-data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("ledger-data").textContent);
const NS = "http://www.w3.org/2000/svg";
function el(tag, attrs, parent, text) {
  const e = tag.startsWith("svg:") ? document.createElementNS(NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  if (parent) parent.appendChild(e);
  return e;
}
function fmt(x, d) { return x === null || x === undefined ? "-" : (typeof x === "number" ? x.toFixed(d === undefined ? 3 : d) : String(x)); }

// ---------------------------------------------------------------- summary
(function () {
  const s = D.summary, box = document.getElementById("summary");
  el("p", {}, box, `${s.steps} steps, ${s.trajectories} trajectories, ${s.consumed} consumed by an update; ` +
     `ledger ${(s.bytes.per_trajectory / 1024).toFixed(2)} KiB per trajectory`);
  const t = el("table", {id: "releases"}, box);
  const h = el("tr", {}, t); ["release", "checkpoint hash", "published at step"].forEach(x => el("th", {}, h, x));
  for (const r of s.releases) { const tr = el("tr", {}, t); el("td", {}, tr, "v" + r.version);
    el("td", {}, tr, r.checkpoint_hash); el("td", {}, tr, r.published_at_step); }
})();

// ---------------------------------------------------------------- timeline (a picture made by matplotlib)
(function () {
  const box = document.getElementById("timeline");
  if (!D.timeline) { el("p", {}, box, "No timeline recorded for this run."); return; }
  const img = el("img", {id: "timeline-png", alt: "timeline: what each rank and engine did", style: "max-width:100%"}, box);
  img.onload = () => img.setAttribute("data-width", img.naturalWidth);     // decoded: it shows
  img.src = "data:image/png;base64," + D.timeline;
  el("p", {}, box, "The same as a trace: hybridrl inspect RUN_DIR --timeline (open it at ui.perfetto.dev).");
})();

// ---------------------------------------------------------------- line charts
function lineChart(id, title, series, yMax) {
  const W = 420, H = 220, L = 42, B = 30, box = el("div", {class: "chart"}, document.getElementById("curves"));
  el("div", {}, box, title);
  const svg = el("svg:svg", {id: id, width: W, height: H, viewBox: `0 0 ${W} ${H}`}, box);
  const pts = series.flatMap(s => s.points);
  if (!pts.length) { el("svg:text", {x: 60, y: 100}, svg, "no data"); return; }
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(0, ...ys), y1 = yMax || Math.max(1e-9, ...ys);
  const X = x => L + (x - x0) / (x1 - x0) * (W - L - 10), Y = y => H - B - (y - y0) / (y1 - y0 || 1) * (H - B - 10);
  el("svg:line", {x1: L, y1: H - B, x2: W - 10, y2: H - B, stroke: "#999"}, svg);
  el("svg:line", {x1: L, y1: 10, x2: L, y2: H - B, stroke: "#999"}, svg);
  el("svg:text", {x: 2, y: Y(y1) + 4, "font-size": 10}, svg, fmt(y1, 2));
  el("svg:text", {x: 2, y: Y(y0) + 4, "font-size": 10}, svg, fmt(y0, 2));
  el("svg:text", {x: L, y: H - 8, "font-size": 10}, svg, "step " + x0);
  el("svg:text", {x: W - 60, y: H - 8, "font-size": 10}, svg, "step " + x1);
  series.forEach((s, i) => {
    if (!s.points.length) return;
    el("svg:polyline", {class: "series", "data-name": s.name, fill: "none", stroke: s.color, "stroke-width": 2,
                        points: s.points.map(p => X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1)).join(" ")}, svg);
    s.points.forEach(p => el("svg:circle", {cx: X(p[0]), cy: Y(p[1]), r: 3, fill: s.color}, svg)
      .appendChild(el("svg:title", {}, null, `${s.name} step ${p[0]}: ${fmt(p[1])}`)));
    el("svg:text", {x: L + 8, y: 22 + 13 * i, fill: s.color, "font-size": 11}, svg, s.name);
  });
}
lineChart("reward-curve", "Training reward per step",
          [{name: "reward/mean", color: "#1f77b4", points: D.curves.reward},
           {name: "reward/accuracy", color: "#2ca02c", points: D.curves.accuracy}]);
lineChart("validation-curve", "Validation accuracy", [{name: "val/accuracy", color: "#d62728", points: D.curves.validation}], 1);
const PALETTE = ["#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#ff7f0e", "#1f77b4"];
if (D.evaluations.length)
  lineChart("evaluation-curve", "Evaluations across checkpoints (hybridrl eval)",
            D.evaluations.map((s, i) => ({name: s.name, color: PALETTE[i % PALETTE.length], points: s.points})), 1);
else
  el("p", {}, document.getElementById("curves"), "No evaluation recorded: hybridrl eval SUITE --run RUN_DIR.");

// ---------------------------------------------------------------- stacked stage bars
(function () {
  const names = ["rollout", "sync", "prep", "train", "store", "other"];
  const colors = {rollout: "#1f77b4", sync: "#ff7f0e", prep: "#9467bd", train: "#2ca02c", store: "#d62728", other: "#bbb"};
  const box = el("div", {class: "chart"}, document.getElementById("stages"));
  const W = Math.max(300, 60 + 34 * D.stages.length), H = 240, B = 30, L = 42;
  const svg = el("svg:svg", {id: "stage-bars", width: W, height: H}, box);
  const top = Math.max(1e-9, ...D.stages.map(s => names.reduce((a, n) => a + s[n], 0)));
  const bw = Math.min(26, (W - L - 10) / Math.max(1, D.stages.length) - 4);
  el("svg:text", {x: 2, y: 14, "font-size": 10}, svg, fmt(top, 2) + "s");
  D.stages.forEach((s, i) => {
    let y = H - B; const x = L + i * (bw + 4);
    for (const n of names) {
      const h = s[n] / top * (H - B - 10);
      const r = el("svg:rect", {class: "stage", "data-stage": n, "data-step": s.step, x: x, y: y - h, width: bw,
                                height: Math.max(0, h), fill: colors[n]}, svg);
      el("svg:title", {}, r, `step ${s.step} ${n}: ${fmt(s[n])}s`);
      y -= h;
    }
    el("svg:text", {x: x, y: H - B + 14, "font-size": 10}, svg, s.step);
  });
  const lg = el("div", {class: "legend"}, box);
  names.forEach(n => el("span", {style: `background:${colors[n]};color:#fff`}, lg, n));
})();

// ---------------------------------------------------------------- steps: lag and filter reasons
(function () {
  const t = el("table", {id: "step-table"}, document.getElementById("steps"));
  const h = el("tr", {}, t);
  ["step", "policy v (rollout -> after)", "episodes", "trained on", "max lag", "not trained on (why)", "status",
   "store s"].forEach(x => el("th", {}, h, x));
  for (const s of D.steps) {
    const tr = el("tr", {"data-step": s.step}, t);
    [s.step, `v${s.version[0]} -> v${s.version[1]}`, s.episodes, s.admitted, s.lag_max,
     Object.entries(s.filters).map(([k, v]) => `${k} ${v}`).join(", ") || "-",
     Object.entries(s.statuses).map(([k, v]) => `${k} ${v}`).join(", "), fmt(s.store_s, 4)]
      .forEach(x => el("td", {}, tr, String(x)));
  }
})();

// ---------------------------------------------------------------- cost: device-seconds by stage, never-trained work
(function () {
  const c = D.cost, box = document.getElementById("cost");
  if (!c) { el("p", {}, box, "no cost data"); return; }
  if (c.error) { el("p", {}, box, "the books could not be made: " + c.error); return; }
  const m = c.money;
  el("p", {}, box, `wall ${fmt(c.wall_s, 1)}s x ${c.world_size} ranks = ${fmt(c.device_s_expected, 1)} device-s; ` +
     `assigned ${fmt(c.device_s_total, 1)}; ${fmt(m.total, 6)} ${m.currency} (${m.device_kind} at ${m.device_hour}/device-hour)` +
     (m.per_million_admitted_tokens ? `; ${fmt(m.per_million_admitted_tokens, 4)} per million admitted tokens` : ""));
  const fam = Object.entries(c.by_family).sort((a, b) => b[1] - a[1]);
  const total = Math.max(1e-9, c.device_s_total), W = 900;
  const svg = el("svg:svg", {id: "cost-bar", width: W, height: 34}, box);
  let x = 0;
  fam.forEach(([k, v], i) => {
    const w = v / total * W;
    const r = el("svg:rect", {class: "cost", "data-family": k, x: x, y: 0, width: Math.max(0, w), height: 24,
                              fill: `hsl(${(i * 47) % 360}, 60%, ${k === "idle" ? 80 : 55}%)`}, svg);
    el("svg:title", {}, r, `${k}: ${fmt(v, 1)} device-s (${fmt(100 * v / total, 1)}%)`);
    if (w > 40) el("svg:text", {x: x + 3, y: 16, "font-size": 11}, svg, k);
    x += w;
  });
  const t = el("table", {id: "cost-stages"}, box), h = el("tr", {}, t);
  ["stage", "device-s", "share"].forEach(x => el("th", {}, h, x));
  Object.entries(c.by_stage).sort((a, b) => b[1] - a[1]).forEach(([k, v]) => {
    const tr = el("tr", {"data-stage": k}, t);
    [k, fmt(v, 2), fmt(100 * v / total, 1) + "%"].forEach(x => el("td", {}, tr, x)); });
  const n = el("table", {id: "cost-never-trained"}, box), nh = el("tr", {}, n);
  ["generation by outcome", "episodes", "policy tokens", "rollout device-s"].forEach(x => el("th", {}, nh, x));
  Object.entries(c.never_trained || {}).forEach(([k, v]) => {
    const tr = el("tr", {"data-reason": k}, n);
    [k, v.trajectories, v.policy_tokens, fmt(v.device_s, 2)].forEach(x => el("td", {}, tr, String(x))); });
  (c.notes || []).forEach(x => el("p", {class: "note"}, box, "note: " + x));
})();

// ---------------------------------------------------------------- episodes token by token
const VCOL = (v, a) => `hsla(${(v * 67) % 360}, 75%, 50%, ${a === undefined ? 1 : a})`;
(function () {
  const versions = new Set();
  D.episodes.forEach(e => (e.tokens ? e.tokens.versions : []).forEach(v => { if (v >= 0) versions.add(v); }));
  const lg = document.getElementById("legend");
  el("span", {}, lg, "token colour = policy version, strength = probability (exp logprob); hover a token:");
  [...versions].sort((a, b) => a - b).forEach(v => el("span", {style: `background:${VCOL(v)};color:#fff`}, lg, "v" + v));
  el("span", {class: "obs"}, lg, "observation / template (not trained)");
  const root = document.getElementById("episodes");
  for (const e of D.episodes) {
    const box = el("div", {class: "episode", "data-id": e.id}, root);
    const used = e.update.consumed ? `consumed by the update of step ${e.update.step} (v${e.update.policy_version_before} -> v${e.update.policy_version_after})`
                                   : `not trained on: ${e.update.filter_reason}`;
    el("h3", {}, box, `${e.id}`);
    el("div", {}, box, `step ${e.step} · ${e.status}${e.truncation ? " (" + e.truncation + ")" : ""} · reward ${fmt(e.reward.total)} · ${used}`);
    const rt = el("table", {class: "rewards"}, box), rh = el("tr", {}, rt);
    ["reward component", "value", "evaluator"].forEach(x => el("th", {}, rh, x));
    for (const [k, c] of Object.entries(e.reward.components)) {
      const tr = el("tr", {}, rt); el("td", {}, tr, k); el("td", {}, tr, fmt(c.value)); el("td", {}, tr, c.evaluator); }
    if (e.advantage && e.advantage.computed !== false)
      el("div", {class: "advantage"}, box, `advantage ${fmt(e.advantage.value, 4)} = ${e.advantage.formula}; group rewards ${JSON.stringify(e.advantage.group_rewards)}`);
    if (!e.tokens) { el("div", {}, box, "token data deleted by retention"); continue; }
    const tk = e.tokens, pieces = (e.text && e.text.pieces) || tk.response_ids.map(i => `[${i}]`);
    if (e.text && e.text.prompt) el("div", {class: "tokens prompt"}, box, e.text.prompt);
    const byTurn = {};
    e.actions.forEach(a => byTurn[a.turn] = a);
    const spans = turnOfPosition(e);
    let cur = null, curTurn = -2;
    for (let i = 0; i < tk.response_ids.length; i++) {
      const t = spans[i] === undefined ? -1 : spans[i];
      if (t !== curTurn) {
        curTurn = t; const tb = el("div", {class: "turn", "data-turn": t}, box);
        const tim = (e.timings.turns || []).find(x => x.turn === t);
        el("div", {style: "font-size:12px;color:#555"}, tb, `turn ${t}` + (tim ? ` · generate ${fmt(tim.generate_s)}s (prefill ${fmt(tim.prefill_s)}s, decode ${fmt(tim.decode_s)}s) · tool ${fmt(tim.tool_s)}s · env ${fmt(tim.env_s)}s` : ""));
        cur = el("div", {class: "tokens"}, tb);
        const a = byTurn[t];
        if (a) {
          const acts = el("div", {class: "actions"}, tb, `parser: answer ${a.parsed.answer ? "yes" : "no"}, ${a.parsed.calls} tool calls, ${a.parsed.errors} malformed`);
          for (const d of a.decisions) el("div", {class: d.decision === "authorized" && d.ok !== false ? "ok" : "bad"}, acts,
             `${d.tool}: ${d.decision}` + (d.message ? " - " + d.message : d.ok ? " - ran ok" : " - " + (d.error || "")));
        }
        e.environment.env_steps.filter(s => s.turn === t).forEach(s =>
          el("div", {class: "env"}, tb, `environment step: reward ${s.reward}, done ${s.done}`));
      }
      const m = tk.mask[i], v = tk.versions[i], lp = tk.behavior_logprobs[i];
      const attrs = {class: "tok" + (m ? "" : " obs")};
      if (m) {
        const p = Math.exp(lp);
        attrs.style = `background:${VCOL(v, 0.2 + 0.8 * p)};border-bottom:2px solid ${VCOL(v)}`;
        attrs["data-version"] = v; attrs["data-logprob"] = lp.toFixed(4);
        const old = tk.old_logprobs ? tk.old_logprobs[i] : null;
        const adv = tk.advantages ? tk.advantages[i] : (e.advantage && e.advantage.computed !== false ? e.advantage.value : null);
        attrs.title = `${JSON.stringify(pieces[i])} · id ${tk.response_ids[i]} · policy v${v} · logprob ${lp.toFixed(4)}` +
                      (old !== null ? ` · trainer ${old.toFixed(4)}` : "") + (adv !== null && adv !== undefined ? ` · advantage ${adv.toFixed(4)}` : "");
      } else attrs.title = `observation / template token ${tk.response_ids[i]} (mask 0, not trained)`;
      el("span", attrs, cur, pieces[i]);
    }
    const det = el("details", {}, box); el("summary", {}, det, "the eight answers (JSON)");
    const copy = Object.assign({}, e); delete copy.tokens; delete copy.text;
    el("pre", {}, det, JSON.stringify(copy, null, 1));
  }
})();
function turnOfPosition(e) {
  // response position -> turn, from the generate / observation spans of the trace
  const out = [];
  for (const r of e.spans || []) for (let i = r.start; i < r.end; i++) out[i] = r.turn;
  return out;
}
</script></body></html>
"""
