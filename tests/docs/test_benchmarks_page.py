"""The benchmarks page renders the benchmark records: the committed docs/benchmarks.md is exactly what
`python benchmarks/render_docs.py` writes from the committed docs/benchmarks/*.json, every record keeps the
schema and names commands whose scripts and recipes exist, and a changed or malformed record is caught."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from tests.launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import render_docs  # noqa: E402


@pytest.fixture(scope="module")
def records():
    return render_docs.load_records()


def test_the_committed_page_is_the_rendering_of_the_records(records):
    page = render_docs.PAGE.read_text()
    assert render_docs.page_with_figures(page, records) == page, (
        "docs/benchmarks.md is stale: run `python benchmarks/render_docs.py`")
    for rec in records:
        assert f"### {rec['title']}" in page and f"(benchmarks/{rec['benchmark']}.json)" in page


def test_every_record_names_files_that_exist(records):
    """Each reproduce command's scripts and recipes are files of the repository, and the page's table of
    scripts names every script a record runs."""
    assert len(records) >= 10
    scripts_table = render_docs.PAGE.read_text().split(render_docs.BEGIN)[0]
    for rec in records:
        commands = rec["command"] if isinstance(rec["command"], list) else [rec["command"]]
        paths = [p for c in commands for p in re.findall(r"(?:benchmarks|recipes)/[\w./-]+\.(?:py|yaml)", c)]
        assert [p for p in paths if not (ROOT / p).is_file()] == [], rec["benchmark"]
        for script in (p for p in paths if p.startswith("benchmarks/")):
            assert script in scripts_table, f"{rec['benchmark']}: {script} is not in the page's table of scripts"


def test_figures_keep_their_digits_and_units():
    assert render_docs.format_figure(json.loads('{"value": 0.470, "unit": "s", "spread": [0.323, 0.741]}',
                                                parse_float=render_docs.Decimal)) == "0.470 s [0.323, 0.741]"
    fig = json.loads('{"values": [1.90, 2.4], "unit": "x", "note": "a | b"}', parse_float=render_docs.Decimal)
    assert render_docs.format_figure(fig) == "1.90x, 2.4x (a \\| b)"
    assert render_docs.format_figure({"range": [-2, 7], "unit": "ms"}) == "-2 to 7 ms"
    assert render_docs.format_figure({"value": render_docs.Decimal("1.8e-6"), "unit": ""}) == "1.8e-6"


def test_a_changed_record_makes_the_page_stale_and_a_malformed_one_is_refused(tmp_path, capsys):
    folder = tmp_path / "records"
    shutil.copytree(render_docs.RECORDS, folder)
    page = tmp_path / "benchmarks.md"
    shutil.copy(render_docs.PAGE, page)
    argv = ["--page", str(page), "--records", str(folder)]
    assert render_docs.main([*argv, "--check"]) == 0
    rec = json.loads((folder / "vs_trl.json").read_text())
    rec["figures"]["hybridrl"]["value"] = 0.365
    (folder / "vs_trl.json").write_text(json.dumps(rec))
    assert render_docs.main([*argv, "--check"]) == 1 and "stale" in capsys.readouterr().err
    assert render_docs.main(argv) == 0 and "| hybridrl | 0.365 s/step |" in page.read_text()
    assert render_docs.main([*argv, "--check"]) == 0

    del rec["command"]
    rec["figures"]["hybridrl"] = {"value": "fast", "unit": "s/step"}
    rec["figures"]["TRL"] = {"value": 1.0, "values": [1.0], "unit": "s/step"}
    rec["benchmark"] = "other"
    (folder / "vs_trl.json").write_text(json.dumps(rec))
    with pytest.raises(SystemExit) as refused:
        render_docs.load_records(folder)
    message = str(refused.value)
    assert "vs_trl: 'command' is required" in message
    assert "figures['hybridrl']: 'value' must be a number" in message
    assert "figures['TRL']: exactly one of 'value', 'values', 'range'" in message
    assert "'benchmark' must be the file's stem" in message


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(SystemExit, match="markers are missing"):
        render_docs.page_with_figures("# Benchmarks\n", [])
