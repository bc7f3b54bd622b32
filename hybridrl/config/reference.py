"""The configuration reference page (docs/reference/config.md), written from the config dataclasses.

Every section of the root config and every knob in it, with its type, default and help, in the order
`hybridrl config show` prints them; nested sections get a heading of their own. The page is generated, so
it cannot drift from the code: `hybridrl config reference --write docs/reference/config.md` writes it, and
a test fails when the committed page is not what this module writes.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import typing
from typing import Any, Iterator

from hybridrl.config.fields import field_help

HEADER = """\
# Configuration reference

Generated from the config dataclasses by `hybridrl config reference --write docs/reference/config.md`:
do not edit it by hand (a test fails when it is stale). Every knob below is a recipe key
`section.key` and a command-line override `section.key=value`; [Configuration](../configuration.md)
says how recipes, defaults and overrides combine. `hybridrl config defaults` prints the same defaults
as YAML, and `hybridrl config show RECIPE --diff` what a recipe changes.

"""


def type_name(tp: Any) -> str:
    """A field's annotation as a reader writes it: `int`, `list[str]`, `dict[str, Any]`, `list[MixtureEntry]`."""
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(\w+)", r"\1", str(tp)).replace("NoneType", "None")


def default_text(f: dataclasses.Field) -> str:
    """The default as YAML would hold it (`required` for a field without one)."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    elif isinstance(value, (list, tuple)):
        value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
    if isinstance(value, str):
        return f'`"{value}"`' if value == "" or value != value.strip() else f"`{value}`"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    return f"`{json.dumps(value, default=str)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def knobs(cls: type, prefix: str) -> Iterator[tuple[str, str, str, str] | tuple[str, type, str]]:
    """(key, type, default, help) for each knob of `cls`; (key, class, help) for each nested section."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield f"{prefix}.{f.name}", tp, field_help(f)
        else:
            yield f"{prefix}.{f.name}", type_name(tp), default_text(f), field_help(f)


def section_text(name: str, cls: type, help_text: str, level: int = 2) -> list[str]:
    """One section's heading, its table of knobs, then its nested sections (each a heading of its own)."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    lines = [f"{'#' * level} `{name}`", ""]
    for text in (help_text, doc if not doc.startswith(f"{cls.__name__}(") else ""):
        lines += [text, ""] if text else []
    rows, nested = [], []
    for entry in knobs(cls, name):
        if len(entry) == 3:
            nested.append(entry)
        else:
            key, tp, default, help_ = entry
            rows.append(f"| `{key}` | `{_cell(tp)}` | {_cell(default)} | {_cell(help_)} |")
    if rows:
        lines += ["| knob | type | default | what it does |", "|---|---|---|---|", *rows]
    lines.append("")
    for key, sub, help_ in nested:
        lines += section_text(key, sub, help_, level=min(level + 1, 4))
    return lines


def markdown(schema: type | None = None) -> str:
    """The whole page: a table of sections, then every section."""
    from hybridrl.config.loader import root

    schema = schema or root()
    hints = typing.get_type_hints(schema)
    fields = dataclasses.fields(schema)
    index = ["| section | what it configures |", "|---|---|"]
    index += [f"| [`{f.name}`](#{f.name}) | {_cell(field_help(f))} |" for f in fields]
    body: list[str] = []
    for f in fields:
        body += section_text(f.name, hints[f.name], field_help(f))
    return HEADER + "\n".join(index) + "\n\n" + "\n".join(body).rstrip() + "\n"


def every_key(schema: type | None = None) -> list[str]:
    """Every knob's dotted key (what the page must hold)."""
    from hybridrl.config.loader import root

    schema = schema or root()
    hints = typing.get_type_hints(schema)
    return [key for f in dataclasses.fields(schema) for key in _keys(hints[f.name], f.name)]


def _keys(cls: type, prefix: str) -> list[str]:
    out = []
    for entry in knobs(cls, prefix):
        out += _keys(entry[1], entry[0]) if len(entry) == 3 else [entry[0]]
    return out
