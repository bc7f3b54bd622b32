"""The one registry (hybridrl/registry.py): declared rows by name, shipped ones imported when first
looked up, `module:ATTR` of one's own, a type check at the door, one-line errors naming the key."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import pytest

from hybridrl.config.fields import ConfigValueError
from hybridrl.registry import Lazy, Registry


@dataclass(frozen=True)
class Row:
    name: str
    size: int = 0


ROW_MODULE = """
from tests.test_registry import Row

SHIPPED = Row("shipped", 3)
NOT_A_ROW = 7


class Holder:
    @staticmethod
    def twice(x):
        return 2 * x
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    """A module of rows, importable as `rows_of_mine`, not yet imported."""
    (tmp_path / "rows_of_mine.py").write_text(ROW_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rows_of_mine", raising=False)
    return "rows_of_mine"


def test_a_shipped_row_is_imported_when_first_looked_up(module):
    rows = Registry("widget", key="widget.kind", row=Row, shipped={"shipped": f"{module}:SHIPPED"})
    rows.register(Row("declared", 1))
    assert rows.names() == ["declared", "shipped"] and rows.known("shipped")
    rows.check("kind", "shipped")
    assert module not in sys.modules                   # listing and checking a shipped name import nothing
    assert rows.get("shipped").size == 3 and module in sys.modules
    assert [r.name for r in rows.rows()] == ["declared", "shipped"]


def test_one_of_your_own_is_module_attr_and_type_checked(module):
    rows = Registry("widget", key="widget.kind", row=Row)
    assert rows.get(f"{module}:SHIPPED") == Row("shipped", 3)
    with pytest.raises(ConfigValueError, match=r"'rows_of_mine:NOT_A_ROW': 7 is a int, not an tests.test_registry.Row"):
        rows.get(f"{module}:NOT_A_ROW")
    with pytest.raises(ConfigValueError, match="has no 'Nope'"):
        rows.get(f"{module}:Nope")
    with pytest.raises(ConfigValueError, match="no module 'no_such_module_xyz' in the working directory") as err:
        rows.get("no_such_module_xyz:ROW")
    assert err.value.field == "widget.kind" and "\n" not in str(err.value)
    with pytest.raises(ConfigValueError, match="is not of the form 'module:ATTR'"):
        rows.get("a:b:c")


def test_an_unknown_name_says_what_is_known_and_the_nearest():
    rows = Registry("widget", key="widget.kind", row=Row)
    rows.register(Row("sprocket"))
    with pytest.raises(ConfigValueError, match=r"unknown widget 'sprokcet': did you mean 'sprocket'\? expected one "
                                               r"of \['sprocket'\]") as err:
        rows.get("sprokcet", key="kind")
    assert err.value.field == "kind"


def test_registration_checks_the_type_and_the_name():
    rows = Registry("widget", key="widget.kind", row=Row)
    with pytest.raises(ConfigValueError, match="not an tests.test_registry.Row"):
        rows.register({"name": "dict"})           # type: ignore[arg-type]
    rows.register(Row("a", 1))
    with pytest.raises(ConfigValueError, match="widget name 'a' is taken"):
        rows.register(Row("a", 2))
    classes = Registry("gadget", key="g", row=Exception, subclass=True, name_of=lambda c: c.__name__)
    classes.register(KeyError)
    with pytest.raises(ConfigValueError, match="not a subclass of builtins.Exception"):
        classes.register(int)


def test_check_without_loading_only_reads_the_form(module):
    rows = Registry("widget", key="widget.kind", row=Row)
    rows.check("kind", "anything_yet:UNIMPORTED", load=False)
    assert "anything_yet" not in sys.modules
    with pytest.raises(ConfigValueError, match="not of the form"):
        rows.check("kind", "x:", load=False)


def test_lazy_resolves_a_function_or_a_method_on_first_call(module):
    twice = Lazy(f"{module}:Holder.twice")
    assert module not in sys.modules
    assert twice(4) == 8


def test_two_classes_of_one_name_are_each_found_by_path_and_the_bare_name_is_refused(tmp_path, monkeypatch):
    """feet.py and tasks/feet.py both defining a task called 'feet': neither import fails, each is found
    by its module:Class, and the bare name says which two claim it."""
    for where in (tmp_path, tmp_path / "pkg"):
        where.mkdir(exist_ok=True)
        (where / "same.py").write_text("class Same(Exception):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("same", "pkg", "pkg.same"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    classes = Registry("gadget", key="g", row=Exception, subclass=True, name_of=lambda c: "same")
    first, second = classes.get("same:Same"), classes.get("pkg.same:Same")
    assert first is not second and classes.get("same:Same") is first and classes.get("pkg.same:Same") is second
    assert not classes.known("same")
    with pytest.raises(ConfigValueError, match=r"gadget name 'same' is claimed by pkg.same.Same and same.Same: "
                                               r"name the one you mean as 'module:ATTR'"):
        classes.get("same")


def test_a_shipped_name_is_not_taken_by_a_row_of_ones_own(module):
    rows = Registry("widget", key="widget.kind", row=Row, shipped={"shipped": f"{module}:SHIPPED"})
    with pytest.raises(ConfigValueError, match="takes the name 'shipped' of a shipped widget: give it another name"):
        rows.register(Row("shipped", 9))
    assert rows.get("shipped").size == 3
