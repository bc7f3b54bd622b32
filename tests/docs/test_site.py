"""The documentation site: `mkdocs build --strict` of mkdocs.yml succeeds (every page in the nav, every link
and anchor resolving, the API reference rendered from the docstrings, no warning), and the same settings fail a build that has a broken link; every link of
the README resolves to a file of the repository."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.launch import ROOT

pytest.importorskip("material", reason="mkdocs-material is in the test extra: pip install -e .[test]")
pytest.importorskip("mkdocstrings", reason="mkdocstrings[python] is in the test extra: pip install -e .[test]")


def mkdocs_build(config, site_dir) -> tuple[bool, str]:
    """`mkdocs build --strict` in this process (no interpreter start per build): (built, its warnings)."""
    import logging

    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("mkdocs")
    logger.addHandler(handler)
    try:
        build(load_config(str(config), site_dir=str(site_dir), strict=True))
        built = True
    except Abort:
        built = False
    finally:
        logger.removeHandler(handler)
    return built, "\n".join(r.getMessage() for r in records)


def test_the_site_builds_with_strict(tmp_path):
    built, warnings = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built and not warnings, warnings
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    assert (tmp_path / "site" / "newcomer" / "index.html").exists()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()   # rendered from the docstrings
    assert "make_instances" in api and "is_budget_error" in api and "on_checkpoint" in api


def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path):
    """The site's own validation settings, on a two-page site: a link to a missing page fails it, and so
    does a page that no nav line names."""
    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the other page](other.md).\n")
    (docs / "other.md").write_text("# Other\n")
    config = tmp_path / "mkdocs.yml"
    for nav, broken, expected in ((["index.md", "other.md"], False, None),
                                  (["index.md", "other.md"], True, "missing.md"),
                                  (["index.md"], False, "other.md")):
        (docs / "index.md").write_text("# Home\n\nSee [the other page](other.md)"
                                       + (" and [a page that is not there](missing.md)" if broken else "") + ".\n")
        config.write_text(yaml.safe_dump({**settings, "docs_dir": "docs", "nav": nav}))
        built, warnings = mkdocs_build(config, tmp_path / "site")
        if expected is None:
            assert built and not warnings, warnings
        else:
            assert not built and expected in warnings, warnings


def test_every_readme_link_resolves():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t)]
    assert local, "the README links to the docs"
    assert [t for t in local if t and not (ROOT / t).exists()] == []
    assert len(text.splitlines()) <= 400
