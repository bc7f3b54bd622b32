"""The `rollout` section: which engine generates, its layout, and each engine's own knobs: one
sub-section per registered engine (`rollout.registry.ENGINES`), its row's config class. Each
backend's config lives beside it."""

from __future__ import annotations

import dataclasses

from hybridrl.config.fields import ConfigValueError, check_positive, knob, section
from hybridrl.rollout.registry import ENGINES, RolloutEngineSpec


def _check(self) -> None:
    ENGINES.check("engine", self.engine)
    check_positive("tp", self.tp)
    row = self.engine_row
    if row.single_rank and self.tp != 1:
        raise ConfigValueError("tp", f"{row.single_rank}: set rollout.tp=1")


def _engine_row(self) -> RolloutEngineSpec:
    """The selected engine's row: its classes and what the rest of the run needs to know of it."""
    return ENGINES.get(self.engine)


def _engine_section(self):
    """The selected engine's own section: `rollout.<name>` for a shipped engine; an engine of one's own
    (`module:ATTR`) has no section in the schema and runs with its config class's defaults."""
    row = self.engine_row
    section = vars(self).get(row.name)
    return section if isinstance(section, row.config) else row.config()


def _make() -> type:
    rows = ENGINES.rows()
    fields = [
        ("engine", str, knob("native", " | ".join(f"{r.name} ({r.summary})" for r in rows))),
        ("tp", int, knob(1, "rollout tensor-parallel size: one engine per group of tp ranks, on its first rank "
                            "(the native engine has no TP: with tp > 1 its one replica serves the whole group)")),
        *[(r.name, r.config, section(r.config, r.section_help)) for r in rows],
    ]
    cls = dataclasses.make_dataclass("RolloutConfig", fields, kw_only=True, namespace={
        "__doc__": "The rollout engine of every rank (colocated with the trainer).", "__post_init__": _check,
        "engine_row": property(_engine_row), "engine_section": property(_engine_section)})
    cls.__module__ = __name__
    return cls


RolloutConfig = _make()
