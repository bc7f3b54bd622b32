"""The figures section of docs/benchmarks.md, rendered from the benchmark records in docs/benchmarks/*.json.

    python benchmarks/render_docs.py            # rewrite the section between the page's markers
    python benchmarks/render_docs.py --check    # exit 1 if the committed page differs from the rendering

One record per measured result, one JSON object each (the file's stem is its `benchmark`):

    benchmark       str, the file's stem
    title           str, the section's heading
    command         str or [str]: the exact command(s) that reproduce it
    machine         str: where it ran
    notes           str: the conditions the measurement states (or that they are unknown)
    figures         {name: figure} or {group: {name: figure}} (a group renders as one row of a table)
    order           int, optional: where the section stands on the page (lower first; then by file name)
    date, commit    str, optional: when it was measured, the commit that recorded it
    target          str, optional: the target it was measured against
    interpretation  str, optional: at most a sentence or two on what the figures mean
    profile         [str], optional: what a profile of the measured step found, one finding an item

    figure          {"unit": str, and one of "value": number | "values": [number] | "range": [lo, hi];
                     optional "spread": [lo, hi] beside "value", optional "note": str}

Numbers are read as decimals, so a figure is printed with exactly the digits its record gives.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import unicodedata
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "benchmarks"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- BEGIN figures: rendered by `python benchmarks/render_docs.py` from docs/benchmarks/*.json; do not edit -->"
END = "<!-- END figures -->"

REQUIRED = {"benchmark": str, "title": str, "command": (str, list), "machine": str, "notes": str, "figures": dict}
OPTIONAL = {"order": int, "date": str, "commit": str, "target": str, "interpretation": str, "profile": list}
FIGURE_KEYS = {"unit", "value", "values", "range", "spread", "note"}
NO_SPACE_UNITS = {"x", "%"}


def _is_number(x) -> bool:
    return isinstance(x, (int, Decimal)) and not isinstance(x, bool)


def _pair(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(_is_number(v) for v in x)


def figure_problems(where: str, fig) -> list[str]:
    """What is wrong with one figure (nothing: an empty list)."""
    if not isinstance(fig, dict):
        return [f"{where}: a figure is an object with a unit and a value, values or range"]
    problems = [f"{where}: unknown key {k!r} (one of {sorted(FIGURE_KEYS)})" for k in fig if k not in FIGURE_KEYS]
    if not isinstance(fig.get("unit"), str):
        problems.append(f"{where}: 'unit' (a string, \"\" for a count) is required")
    kinds = [k for k in ("value", "values", "range") if k in fig]
    if len(kinds) != 1:
        problems.append(f"{where}: exactly one of 'value', 'values', 'range' is required, found {kinds}")
    elif kinds[0] == "value" and not _is_number(fig["value"]):
        problems.append(f"{where}: 'value' must be a number")
    elif kinds[0] == "values" and not (fig["values"] and all(_is_number(v) for v in fig["values"])):
        problems.append(f"{where}: 'values' must be a non-empty list of numbers")
    elif kinds[0] == "range" and not _pair(fig["range"]):
        problems.append(f"{where}: 'range' must be [low, high]")
    if "spread" in fig and not ("value" in fig and _pair(fig["spread"])):
        problems.append(f"{where}: 'spread' is [low, high] beside a 'value'")
    if "note" in fig and not isinstance(fig["note"], str):
        problems.append(f"{where}: 'note' must be a string")
    return problems


def record_problems(name: str, rec) -> list[str]:
    """What is wrong with one record against the schema in this module's docstring (nothing: an empty list)."""
    if not isinstance(rec, dict):
        return [f"{name}: a record is a JSON object"]
    problems = [f"{name}: '{k}' is required" for k in REQUIRED if k not in rec]
    problems += [f"{name}: unknown key {k!r}" for k in rec if k not in REQUIRED and k not in OPTIONAL]
    for key, kind in (REQUIRED | OPTIONAL).items():
        if key in rec and not isinstance(rec[key], kind):
            problems.append(f"{name}: '{key}' has the wrong type")
    if rec.get("benchmark") != name:
        problems.append(f"{name}: 'benchmark' must be the file's stem, {name!r}")
    if isinstance(rec.get("command"), list) and not all(isinstance(c, str) for c in rec["command"]):
        problems.append(f"{name}: 'command' is a string or a list of strings")
    if isinstance(rec.get("profile"), list) and not (rec["profile"] and all(isinstance(p, str) for p in rec["profile"])):
        problems.append(f"{name}: 'profile' is a non-empty list of strings (one finding each)")
    if "date" in rec and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(rec["date"])):
        problems.append(f"{name}: 'date' is YYYY-MM-DD")
    if "commit" in rec and not re.fullmatch(r"[0-9a-f]{7,40}", str(rec["commit"])):
        problems.append(f"{name}: 'commit' is a commit hash")
    figures = rec.get("figures")
    if isinstance(figures, dict):
        if not figures:
            problems.append(f"{name}: 'figures' is empty")
        for fname, fig in figures.items():
            if isinstance(fig, dict) and "unit" not in fig and fig and all(isinstance(v, dict) for v in fig.values()):
                for inner, f in fig.items():
                    problems += figure_problems(f"{name}: figures[{fname!r}][{inner!r}]", f)
            else:
                problems += figure_problems(f"{name}: figures[{fname!r}]", fig)
    return problems


def load_records(folder: Path = RECORDS) -> list[dict]:
    """Every record of `folder`, in page order; a record that breaks the schema stops it, named."""
    records, problems = [], []
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text(), parse_float=Decimal)
        problems += record_problems(path.stem, rec)
        records.append(rec)
    if problems:
        raise SystemExit("benchmark records that break the schema (benchmarks/render_docs.py):\n  "
                         + "\n  ".join(problems))
    return sorted(records, key=lambda r: (r.get("order", 100), r["benchmark"]))


def _num(x, unit: str) -> str:
    text = format(x, "e") if isinstance(x, Decimal) and x and x.adjusted() < -3 else str(x)
    if not unit:
        return text
    return f"{text}{unit}" if unit in NO_SPACE_UNITS else f"{text} {unit}"


def format_figure(fig: dict) -> str:
    """One figure as the page prints it: `0.473 s`, `2.63x [2.51, 2.69]`, `-2 to 7 ms`, `2.69x, 2.51x`."""
    unit = fig["unit"]
    if "value" in fig:
        text = _num(fig["value"], unit)
        if "spread" in fig:
            text += f" [{fig['spread'][0]}, {fig['spread'][1]}]"
    elif "values" in fig:
        text = ", ".join(_num(v, unit) for v in fig["values"])
    else:
        text = f"{fig['range'][0]} to {_num(fig['range'][1], unit)}"
    if fig.get("note"):
        text += f" ({fig['note']})"
    return text.replace("|", "\\|")


def _is_group(fig: dict) -> bool:
    return "unit" not in fig


def figures_tables(figures: dict) -> list[str]:
    """The flat figures as one two-column table, the groups as one table with a row per group."""
    lines: list[str] = []
    flat = {k: f for k, f in figures.items() if not _is_group(f)}
    if flat:
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {k} | {format_figure(f)} |" for k, f in flat.items()]
    for table in _tables_of_groups({k: f for k, f in figures.items() if _is_group(f)}):
        columns = list(dict.fromkeys(c for g in table.values() for c in g))
        if lines:
            lines.append("")
        lines += ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for k, g in table.items():
            cells = [format_figure(g[c]) if c in g else "-" for c in columns]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def _tables_of_groups(groups: dict) -> list[dict]:
    """Consecutive groups share a table while one's names are among the first's; another set starts a table."""
    tables: list[dict] = []
    for k, g in groups.items():
        if tables and set(g) <= set(next(iter(tables[-1].values()))):
            tables[-1][k] = g
        else:
            tables.append({k: g})
    return tables


def render_record(rec: dict) -> str:
    """One benchmark's section: heading, interpretation, figures, the profile's findings, how to reproduce,
    where and when."""
    lines = [f"### {rec['title']}", ""]
    if rec.get("interpretation"):
        lines += [rec["interpretation"], ""]
    lines += figures_tables(rec["figures"]) + [""]
    if rec.get("profile"):
        lines += ["What the profile found:", "", *(f"- {p}" for p in rec["profile"]), ""]
    commands = rec["command"] if isinstance(rec["command"], list) else [rec["command"]]
    lines += ["Reproduce:", "", "```bash", *commands, "```", ""]
    facts = [f"**Machine**: {rec['machine']}."]
    if rec.get("target"):
        facts.append(f"**Target**: {rec['target']}.")
    when = " ".join(x for x in (rec.get("date", ""), f"(commit `{rec['commit']}`)" if rec.get("commit") else "") if x)
    facts.append(f"**Measured**: {when or 'date not recorded'}.")
    facts.append(f"**Conditions**: {rec['notes']}")
    facts.append(f"**Record**: [`{rec['benchmark']}.json`](benchmarks/{rec['benchmark']}.json).")
    lines += [" ".join(facts), ""]
    return "\n".join(lines)


def anchor(title: str) -> str:
    """The heading's anchor as the site's table of contents makes it (Python-Markdown's toc slugify)."""
    text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def index_table(records: list[dict]) -> list[str]:
    """One row per record: its section, the target it was measured against, when."""
    lines = ["| benchmark | target | measured |", "|---|---|---|"]
    for rec in records:
        lines.append(f"| [{rec['title']}](#{anchor(rec['title'])}) | {rec.get('target', '-')} | "
                     f"{rec.get('date', '-')} |")
    return lines


def render(records: list[dict]) -> str:
    """The whole generated section, markers included: the index, then each record's section."""
    body = "\n".join(render_record(r) for r in records)
    index = "\n".join(index_table(records))
    return f"{BEGIN}\n\n{index}\n\n{body}\n{END}"


def page_with_figures(page: str, records: list[dict]) -> str:
    """`page` with the text between its markers replaced by the rendering of `records`."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{PAGE.relative_to(ROOT)}: the markers are missing; put these two lines where the "
                         f"figures go:\n{BEGIN}\n{END}")
    return page[:start] + render(records) + page[end + len(END):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not the rendering of the records")
    ap.add_argument("--page", type=Path, default=PAGE)
    ap.add_argument("--records", type=Path, default=RECORDS)
    args = ap.parse_args(argv)
    page = args.page.read_text()
    new = page_with_figures(page, load_records(args.records))
    if args.check:
        if new != page:
            print(f"{args.page} is stale: run `python benchmarks/render_docs.py`", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
