"""`hybridrl inspect RUN_DIR [TRAJECTORY] [--step N] [--failed] [--tool-errors] [--lagged] [--reward R]
[--json] [--html OUT.html] [--timeline [--steps A-B] [--out trace.json]]`: the run ledger, read back.

No selection: the run's summary (steps, trajectories, what was consumed, filter reasons, releases,
the ledger's size per trajectory). A trajectory (id, trace id or a unique prefix), or a selection
that matches one trajectory: the episode as text (prompt, each turn, each tool output) and the eight trace
questions answered for it. A selection that matches
several: one line each (add a trajectory id for the answers). `--timeline`: what every rank and
engine did over the steps, as a Chrome / Perfetto trace and a PNG of it (`inspect/timeline.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridrl.inspect.query import RunLedger


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory of an RL run (run.dir)")
    p.add_argument("trajectory", nargs="?", default=None,
                   help="trajectory id, trace id, or a unique prefix of either: answer the trace questions for it")
    p.add_argument("--step", type=int, default=None, help="only trajectories of this RL step")
    p.add_argument("--failed", action="store_true", help="only failed, infra_invalid or aborted episodes")
    p.add_argument("--tool-errors", action="store_true",
                   help="only episodes with a tool error or a refused action (malformed, unauthorized, ...)")
    p.add_argument("--lagged", action="store_true", help="only episodes with tokens older than the step's policy")
    p.add_argument("--reward", type=float, default=None, metavar="R", help="only episodes whose reward is R")
    p.add_argument("--limit", type=int, default=50, help="most trajectories listed (default 50)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--html", default=None, metavar="OUT.html",
                   help="write one self-contained page: curves, stage times, filter reasons, episodes token by token")
    p.add_argument("--episodes", type=int, default=12,
                   help="episodes rendered in the --html page (the selection's first; default 12)")
    p.add_argument("--timeline", action="store_true",
                   help="write a Chrome / Perfetto trace (one track per rank and per engine) and a PNG of it")
    p.add_argument("--steps", default=None, metavar="A-B", help="--timeline: only these steps (inclusive)")
    p.add_argument("--out", default=None, metavar="TRACE.json",
                   help="--timeline: where the trace goes (default RUN_DIR/timeline.json; the PNG beside it)")


def main(args: argparse.Namespace) -> int:
    if args.timeline:
        return timeline(args)
    try:
        ledger = RunLedger(args.run_dir)
        filters = dict(step=args.step, failed=args.failed, tool_errors=args.tool_errors, lagged=args.lagged,
                       reward=args.reward)
        selecting = args.step is not None or args.reward is not None or args.failed or args.tool_errors or args.lagged
        if args.html:
            from hybridrl.inspect.html import write_html

            ids = [ledger.resolve(args.trajectory)] if args.trajectory else [r["id"] for r in ledger.select(**filters)]
            path = write_html(ledger, args.html, ids[: args.episodes] if (args.trajectory or selecting)
                              else _spread(ledger, args.episodes))
            print(f"wrote {path}")
            return 0
        if args.trajectory:
            out: Any = ledger.explain(ledger.resolve(args.trajectory))
            kind = "trajectory"
        elif selecting:
            rows = ledger.select(**filters)
            if len(rows) == 1:
                out, kind = ledger.explain(rows[0]["id"]), "trajectory"
            else:
                out, kind = {"matches": len(rows), "trajectories": rows[: args.limit]}, "list"
        else:
            out, kind = ledger.summary(), "summary"
    except (FileNotFoundError, KeyError) as err:
        print(f"hybridrl inspect: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print({"trajectory": format_trajectory, "list": format_list, "summary": format_summary}[kind](out))
    return 0


def timeline(args: argparse.Namespace) -> int:
    from hybridrl.inspect.timeline import parse_steps, write_timeline

    try:
        trace, png = write_timeline(args.run_dir, args.out, parse_steps(args.steps))
    except (FileNotFoundError, KeyError, ValueError) as err:
        print(f"hybridrl inspect: {err.args[0] if isinstance(err, KeyError) else err}", file=sys.stderr)
        return 2
    print(f"wrote {trace} (open it at https://ui.perfetto.dev or chrome://tracing) and {png}")
    return 0


def _spread(ledger: RunLedger, n: int) -> list[str]:
    """Up to n episodes for the page: the first of each step in turn, then the seconds, ..."""
    by_step: dict[int, list[str]] = {}
    for r in ledger.select():
        by_step.setdefault(r["step"], []).append(r["id"])
    out: list[str] = []
    rank = 0
    while len(out) < n and any(rank < len(v) for v in by_step.values()):
        out += [v[rank] for v in by_step.values() if rank < len(v)][: n - len(out)]
        rank += 1
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}ms" if x < 1 else f"{x:.2f}s"


def format_summary(s: dict) -> str:
    b = s["bytes"]
    lines = [f"run {s['run_dir']}: {s['steps']} steps, {s['trajectories']} trajectories, {s['consumed']} consumed "
             "by an update",
             "  status: " + ", ".join(f"{k} {v}" for k, v in sorted(s["statuses"].items())),
             "  not trained on: " + (", ".join(f"{k} {v}" for k, v in sorted(s["filter_reasons"].items())) or "none"),
             f"  ledger: {b['data'] / 1024:.1f} KiB data + {b['text'] / 1024:.1f} KiB text, "
             f"{b['per_trajectory'] / 1024:.2f} KiB per trajectory"
             + (f"; data of steps {s['pruned_steps']} deleted by retention" if s["pruned_steps"] else "")]
    for r in s["releases"]:
        what = PUBLISHED_FOR.get(r.get("published_for"), "its rollout")
        lines.append(f"  release v{r['version']} ({_made_by(r['version'], r['training_step'])}): "
                     f"{r['checkpoint_hash']}, published at step {r['published_at_step']} for {what}")
    if s.get("diagnosis"):
        lines.append(f"  {s['diagnosis']}")
    for e in s["events"]:
        lines.append(f"  event {e['kind']} at step {e['step']}: {e['detail']}")
    lines += format_evaluations(s.get("evaluations", []))
    return "\n".join(lines)


PUBLISHED_FOR = {"validation": "the validation after its update", "evaluation": "the evaluation after its update"}


def _made_by(version: int, training_step: int) -> str:
    return "the initial weights" if version == 0 else f"the update of step {training_step}"


def format_evaluations(rows: list[dict]) -> list[str]:
    """Which checkpoint scored what on which suite (the ledger's evaluations), one line each."""
    lines = []
    for r in rows:
        scores = ", ".join(f"{sampling} " + " ".join(f"{k} {100 * v:.1f}%" for k, v in values.items()
                                                     if k == "accuracy" or k.startswith("pass@"))
                           for sampling, values in r["metrics"]["sampling"].items())
        where = r["checkpoint"] or "no checkpoint at this step"
        lines.append(f"  eval {r['suite']} v{r['suite_version']} ({r['suite_hash']}) step {r['step']} "
                     f"({r['source']}, policy v{r['policy_version'] if r['policy_version'] is not None else '?'}, "
                     f"model {str(r['model_hash'])[:12]}, {where}): {scores}")
    return lines


def format_list(out: dict) -> str:
    lines = [f"{out['matches']} trajectories" + (f" (first {len(out['trajectories'])})"
                                                   if out["matches"] > len(out["trajectories"]) else "")]
    for r in out["trajectories"]:
        used = f"update {r['consumed_step']}" if r["consumed_step"] is not None else f"not trained: {r['filter_reason']}"
        lines.append(f"  {r['id']}  step {r['step']}  {r['status']}  reward {r['reward']:g}  lag {r['lag']}  "
                     f"tool errors {r['tool_errors']}  refused actions {r['action_errors']}  {used}")
    return "\n".join(lines)


def _indented(text: str, prefix: str = "   | ") -> list[str]:
    return [prefix + line for line in (text.rstrip("\n") or "(empty)").split("\n")]


def format_episode(e: dict) -> list[str]:
    """The episode as text: the prompt (rendered with the chat template), then each turn's generated
    text and each tool or environment observation, in order."""
    text = e.get("text") or {}
    pieces = text.get("pieces")
    if not text.get("prompt") and not pieces:
        why = "its data was deleted by retention" if e.get("data") != "present" else "the run kept no text (store.text=false)"
        return [f"episode: no text ({why})"]
    lines = ["episode:", "  prompt:", *_indented(text.get("prompt") or "")]
    spans = sorted(e.get("spans") or [], key=lambda s: s["start"])
    if pieces is not None and not spans and pieces:
        spans = [{"kind": "generate", "turn": 0, "start": 0, "end": len(pieces)}]
    for span in spans:
        who = (f"turn {span['turn']}, the policy" if span["kind"] == "generate"
               else f"turn {span['turn']}, tool / environment output")
        lines += [f"  {who} ({span['end'] - span['start']} tokens):",
                  *_indented("".join((pieces or [])[span["start"]: span["end"]]))]
    if text.get("answer") is not None:
        reward = e["reward"]["total"] if isinstance(e["reward"], dict) else e["reward"]
        lines.append(f"  answer: {text['answer']!r}; reward {reward:g}")
    return lines


def format_trajectory(e: dict) -> str:
    lines = [f"trajectory {e['id']} (trace {e['trace_id']}): step {e['step']}, {e['status']}"
             + (f" ({e['truncation']})" if e["truncation"] else "") + (f": {e['end_reason']}" if e["end_reason"] else "")
             + (f"; data {e['data']}" if e["data"] != "present" else "")]
    lines += format_episode(e)
    p = e["policy"]
    lines.append(f"1. policy and sampler: {p['policy_tokens']} policy tokens of model {p['model']}, lag {p['lag']}, "
                 f"sampler contract v{p['sampler_contract']}")
    for v, info in p["by_version"].items():
        rel = info["release"]
        rel = rel if isinstance(rel, str) else f"release {rel['checkpoint_hash']} (published at step {rel['published_at_step']})"
        lines.append(f"   v{v}: {info['tokens']} tokens, {rel}")
    for r in p["requests"]:
        lines.append(f"   request {r['request_id']}: v{r['version']}, {r['tokens']} tokens, temperature {r['temperature']}, "
                     f"top_p {r['top_p']}, top_k {r['top_k']}, seed {r['seed']}, finish {r['finish']}")
    lines.append("2. timings: episode " + ", ".join(f"{k} {_s(v)}" for k, v in e["timings"]["episode"].items()))
    for t in e["timings"]["turns"]:
        lines.append(f"   turn {t['turn']}: generate {_s(t['generate_s'])} (queued {_s(t['queued_s'])}, prefill "
                     f"{_s(t['prefill_s'])}, decode {_s(t['decode_s'])}, {t['tokens']} tokens), tool {_s(t['tool_s'])}, "
                     f"env {_s(t['env_s'])}")
    lines.append("3. parser / authorizer:" + ("" if e["actions"] else " no turn was parsed"))
    for a in e["actions"]:
        parsed = a["parsed"]
        answer = "read by the agent" if parsed["answer"] is None else "yes" if parsed["answer"] else "no"
        lines.append(f"   turn {a['turn']}: answer {answer}, {parsed['calls']} tool calls, {parsed['errors']} malformed")
        for d in a["decisions"]:
            detail = d.get("message") or ("ok" if d.get("ok") else f"error: {d.get('error')}")
            lines.append(f"     {d['tool']}: {d['decision']} - {detail}")
    env = e["environment"]
    results = sum((o.get("roles") or []).count("tool") for o in env["observations"])
    lines.append(f"4. environment: {len(env['env_steps'])} transitions, {len(env['side_effects'])} tool executions"
                 + (f" ({results} tool results in the conversation)" if results else ""))
    for s in env["env_steps"]:
        lines.append(f"   turn {s['turn']}: reward {s['reward']}, done {s['done']}, {_s(s['seconds'])}")
    for s in env["side_effects"]:
        lines.append(f"   turn {s['turn']}: ran {s['tool']} ({'ok' if s['ok'] else 'error: ' + str(s['error'])}, "
                     f"{_s(s['latency_s'])})")
    r = e["reward"]
    lines.append(f"5. reward {r['total']:g}: " + ", ".join(f"{k} {c['value']:g} from {c['evaluator']}"
                                                         for k, c in r["components"].items()))
    a = e["advantage"]
    if a.get("computed") is False:
        lines.append(f"6. advantage: none ({a['why']})")
    else:
        value = "?" if a["value"] is None else f"{a['value']:.4g}"
        lines.append(f"6. advantage {value}: {a['estimator']}, {a['formula']}; group {a['group']} of "
                     f"{a['group_size']}, rewards {a['group_rewards']}, mean {a['group_mean']:.4g}, "
                     f"std {a['group_std']:.4g}" + (f", baseline {a['baseline']:.4g}" if "baseline" in a else ""))
    u = e["update"]
    lines.append(f"7. update: step {u['step']} (batch row {u['batch_row']}, {u['tokens_trained']} tokens), policy "
                 f"v{u['policy_version_before']} -> v{u['policy_version_after']}" if u["consumed"]
                 else f"7. update: none (not admitted: {u['filter_reason']})")
    c = e["checkpoint"]
    if c.get("resulted", 1) is None:
        lines.append(f"8. checkpoint: none ({c['why']})")
    else:
        rel = c["release"]
        text = (f"8. release v{c['policy_version']}: " + (f"{rel['checkpoint_hash']} (published at step "
                                                          f"{rel['published_at_step']})" if rel else c["release_note"]))
        ck = c["checkpoint"]
        text += (f"; checkpoint {ck['path']} (step {ck['step']}" + ("" if ck["complete"] else f", {ck['note']}") + ")"
                 if ck else f"; {c['checkpoint_note']}")
        lines.append(text)
    return "\n".join(lines)
