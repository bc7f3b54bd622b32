"""`hybridrl cost RUN_DIR [RUN_DIR ...]`: the books as a text table or JSON.

Several run directories add up to the development cost (every attempt of every run, the time lost
to faults included); the last one given is the final run, whose marginal cost is what running it
once more would cost: its books without the time killed attempts lost.
"""

from __future__ import annotations

from typing import Any

from hybridrl.cost.accounting import Books
from hybridrl.cost.prices import Prices, device_kind, money
from hybridrl.cost.records import MALFORMED


def _dur(s: float) -> str:
    s = float(s)
    if s >= 3600:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    if s >= 60:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{s:.1f}s"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def run_report(books: Books, prices: Prices, kind: str | None = None) -> dict[str, Any]:
    k = device_kind(books, kind)
    m = money(books, prices, k)
    expected = books.wall_s * books.world_size
    closes = abs(books.total_device_s - expected) / expected if expected else None
    return {**books.to_dict(), "money": m, "books_close_within": closes}


def combine(reports: list[dict]) -> dict[str, Any]:
    """Development cost (all runs, all attempts) beside the final run's marginal cost."""
    final = reports[-1]
    dev = sum(r["money"]["total"] for r in reports)
    marginal = final["money"]["total"] - final["money"]["lost_to_faults"]
    return {"runs": reports,
            "development": {"runs": len(reports), "total": dev,
                            "device_hours": sum(r["device_s_total"] for r in reports) / 3600,
                            "lost_to_faults": sum(r["money"]["lost_to_faults"] for r in reports),
                            "currency": final["money"]["currency"]},
            "final_run": {"run_dir": final["run_dir"], "marginal": marginal,
                          "per_million_admitted_tokens": (marginal / final["tokens"]["admitted"] * 1e6
                                                          if final["tokens"].get("admitted") else None),
                          "per_verified_success": (marginal / final["episodes"]["successes"]
                                                   if final["episodes"].get("successes") else None)}}


def _money(x: float | None, cur: str) -> str:
    """Cents at most: fractions of a cent (a CPU run's) say nothing; the device-hours beside them do."""
    if x is None:
        return "-"
    return f"<0.01 {cur}" if 0 < abs(x) < 0.005 else f"{x:,.2f} {cur}"


def _hours(h: float) -> str:
    return f"{h:,.1f}" if h >= 100 else f"{h:.3g}"


def format_run(r: dict) -> str:
    cur = r["money"]["currency"]
    total = r["device_s_total"] or 1.0
    roles = ", ".join(f"{n} {role}" for role, n in r["roles"].items())
    lines = [f"run {r['run_dir']}: {r['world_size']} ranks ({roles}), {r['steps']} steps, "
             f"{len(r['attempts'])} attempt(s), wall {_dur(r['wall_s'])}",
             f"  device-seconds: {r['device_s_total']:.1f} assigned of wall x ranks = {r['device_s_expected']:.1f} "
             "(wall: the launch to the launcher's exit, on the run's clock.jsonl)", ""]
    priced = r["money"]["device"] >= 0.01       # a money column only where its figures are cents or more
    lines.append(f"  {'stage':<28}{'device-s':>10}{'share':>8}" + (f"{'money':>14}" if priced else ""))
    for role, stages in r["device_s"].items():
        if len(r["device_s"]) > 1:
            lines.append(f"  [{role} ranks]")
        for stage, s in sorted(stages.items(), key=lambda kv: (kv[0].split('/')[0], -kv[1])):
            price = s / 3600 * r["money"]["device_hour"]
            lines.append(f"  {stage:<28}{s:>10.1f}{100 * s / total:>7.1f}%" + (f"{_money(price, cur):>14}" if priced
                                                                               else ""))
    fam = r["by_family"]
    lines.append("  by family: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in
                                              sorted(fam.items(), key=lambda kv: -kv[1])))
    nt = r.get("never_trained") or {}
    if nt:
        generation = sum(v["device_s"] for v in nt.values())
        lines += ["", f"  {'generation by outcome':<28}{'episodes':>9}{'policy tokens':>15}{'rollout dev-s':>15}"
                      f"{'share':>8}"]
        for reason, v in sorted(nt.items(), key=lambda kv: (kv[0] == "validation", kv[0] != "trained", kv[0])):
            share = v["device_s"] / generation if generation else 0.0
            lines.append(f"  {reason:<28}{int(v['trajectories']):>9}{int(v['policy_tokens']):>15}"
                         f"{v['device_s']:>15.1f}{100 * share:>7.1f}%")
    env = r["environment"]
    calls = ", ".join(f"{k} {v}" + (" (their text named no tool: nothing ran)" if k == MALFORMED else "")
                      for k, v in env.get("tool_calls", {}).items()) or "none"
    lines += ["", f"  environment: tools {env.get('tool_s', 0):.1f}s, environment steps {env.get('env_s', 0):.1f}s, "
                  f"verifiers {env.get('reward_s', 0):.1f}s; tool calls: {calls}; sandboxes {env.get('sandboxes', 0)}",
              "  stored: " + ", ".join(f"{k} {_bytes(v)}" for k, v in r["stored_bytes"].items() if v)]
    m, tok, eps = r["money"], r["tokens"], r["episodes"]
    hours, admitted, successes = r["device_s_total"] / 3600, tok.get("admitted") or 0, eps.get("successes") or 0
    lines += [f"  tokens: {int(tok.get('generated', 0))} generated, {int(admitted)} admitted; "
              f"episodes {eps.get('training', 0)} ({eps.get('admitted', 0)} admitted, {successes} "
              f"verified successes), {eps.get('validation', 0)} validation",
              f"  device-hours {_hours(hours)}; per million admitted action tokens "
              + (f"{_hours(hours / admitted * 1e6)} device-hours" if admitted else "-") + "; per verified success "
              + (f"{r['device_s_total'] / successes:.3g} device-seconds" if successes else "-"),
              f"  money ({m['device_kind']} at {m['device_hour']} {cur}/device-hour): device {_money(m['device'], cur)}"
              f" + environment CPU {_money(m['environment_cpu'], cur)} + tool calls {_money(m['tool_calls'], cur)}"
              f" + storage {_money(m['storage'], cur)} = {_money(m['total'], cur)}; per million admitted action "
              f"tokens {_money(m['per_million_admitted_tokens'], cur)}, per verified success "
              f"{_money(m['per_verified_success'], cur)}"]
    for note in r["notes"]:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def format_report(out: dict) -> str:
    parts = [format_run(r) for r in out["runs"]]
    d, f = out["development"], out["final_run"]
    cur = d["currency"]
    parts.append(f"development cost ({d['runs']} run(s), every attempt): {_hours(d['device_hours'])} device-hours "
                 f"({_money(d['total'], cur)}; {_money(d['lost_to_faults'], cur)} lost to faults)\n"
                 f"final run {f['run_dir']}: marginal cost {_money(f['marginal'], cur)} "
                 f"(per million admitted tokens {_money(f['per_million_admitted_tokens'], cur)}, "
                 f"per verified success {_money(f['per_verified_success'], cur)})")
    return "\n\n".join(parts)
