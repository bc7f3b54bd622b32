"""The configuration reference page is generated from the config dataclasses and is current: the committed
docs/reference/config.md is exactly what `hybridrl config reference` writes, every knob of every section is
on it with its type, default and help, and a knob added to a config appears on the page."""

from __future__ import annotations

import dataclasses

from hybridrl.cli import main
from hybridrl.config.fields import field_help, knob, section
from hybridrl.config.reference import every_key, markdown
from tests.launch import ROOT

PAGE = ROOT / "docs" / "reference" / "config.md"


def test_the_committed_page_is_the_generated_one(tmp_path, capsys):
    assert main(["config", "reference", "--write", str(tmp_path / "config.md")]) == 0
    assert (tmp_path / "config.md").read_text() == PAGE.read_text(), (
        "docs/reference/config.md is stale: run `hybridrl config reference --write docs/reference/config.md`")


def test_every_section_and_knob_is_on_the_page():
    from hybridrl.config.loader import root

    text = PAGE.read_text()
    schema = root()
    for f in dataclasses.fields(schema):
        assert f"## `{f.name}`" in text and field_help(f) in text
    keys = every_key()
    assert len(keys) > 200 and "train.lora.rank" in keys and "gateway.render_tools" in keys
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `")}
    missing = [k for k in keys if k not in rows]
    assert missing == []
    row = rows["agent.temperature"].split("|")
    assert row[2].strip() == "`float`" and row[3].strip() == "`1.0`" and "temperature" in row[4]


@dataclasses.dataclass(kw_only=True)
class _Inner:
    depth: int = knob(3, "how deep")


@dataclasses.dataclass(kw_only=True)
class _Toy:
    """A toy section."""

    size: int = knob(4, "how many | of them")
    names: list[str] = knob(help="which", factory=lambda: ["a"])
    inner: _Inner = section(_Inner, "the nested part")


@dataclasses.dataclass(kw_only=True)
class _Root:
    toy: _Toy = section(_Toy, "a toy section")


def test_a_knob_added_to_a_config_appears_with_its_type_default_and_help():
    text = markdown(_Root)
    assert "| `toy.size` | `int` | `4` | how many \\| of them |" in text
    assert '| `toy.names` | `list[str]` | `["a"]` | which |' in text
    assert "### `toy.inner`" in text and "| `toy.inner.depth` | `int` | `3` | how deep |" in text
    assert every_key(_Root) == ["toy.size", "toy.names", "toy.inner.depth"]
