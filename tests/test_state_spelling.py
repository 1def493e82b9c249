"""A state of a parked task has one spelling: the values of ``EntryState``.

Before issue 33 the dashboard's entry page said ``"in flight"`` where
lookup said ``"in_flight"``, because each worked the state out and spelled
it itself. Read from the source with :mod:`ast` (and the templates as
text), without importing anything, these tests fail when the package
spells a state outside :mod:`celery_zdelay.store.read_model`:

- the words ``"in flight"`` as a string anywhere but there (the label for
  people is :attr:`EntryState.label`);
- a state compared with, assigned or passed as a string literal
  (``entry.state == "in_flight"``, ``state = "dead"``,
  ``ParkedTask(state="held")``) rather than an ``EntryState`` member;
- a template comparing a state with either spelling of in flight.

The last test checks the checker on source written for it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

PACKAGE = Path(__file__).resolve().parent.parent / "celery_zdelay"
#: The one module that spells the states.
ENUM_MODULE = PACKAGE / "store" / "read_model.py"
#: Every spelling a state had, and the words of the label.
SPELLINGS = {"parked", "held", "in_flight", "in flight", "in-flight", "dead"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _spelled(node: ast.AST | None) -> bool:
    """Whether *node* is, or holds, a string literal spelling a state."""
    if node is None:
        return False
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in SPELLINGS
        for n in ast.walk(node)
    )


def _is_state(node: ast.AST) -> bool:
    """Whether *node* reads a state: ``state`` or ``<anything>.state``."""
    return (isinstance(node, ast.Name) and node.id == "state") or (
        isinstance(node, ast.Attribute) and node.attr == "state"
    )


def offences(source: str) -> Iterator[tuple[int, str]]:
    """Yield (line, what) for each state spelled outside the enum in *source*."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
            and node.value.strip() == "in flight"
        ):
            yield node.lineno, f"the label {node.value!r}"
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_state(s) for s in sides) and any(_spelled(s) for s in sides):
                yield node.lineno, "a state compared with a string"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_is_state(t) for t in targets) and _spelled(node.value):
                yield node.lineno, "a state assigned a string"
        elif isinstance(node, ast.keyword) and node.arg == "state" and _spelled(node.value):
            yield node.lineno, "a state passed as a string"


def test_the_package_spells_a_state_only_in_the_enum() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != ENUM_MODULE
        for line, what in offences(path.read_text(encoding="utf-8"))
    ]
    assert found == [], "spell states as EntryState members:\n" + "\n".join(found)


#: A state compared with an "in flight" of either spelling, in a template.
_TEMPLATE_STATE = re.compile(r"state\b[^%}]*?(==|!=|\bin\b)[^%}]*?[\"']in[ _-]flight[\"']")


def test_no_template_compares_a_state_with_a_spelling_of_in_flight() -> None:
    found = [
        f"{path.name}: {match.group(0)}"
        for path in sorted((PACKAGE / "web" / "templates").glob("*.html"))
        for match in _TEMPLATE_STATE.finditer(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_the_checker_finds_each_way_of_spelling_a_state() -> None:
    source = '''
"""A docstring may say in flight."""
LABEL = "in flight"
if entry.state == "in_flight":
    pass
if "dead" != task.state:
    pass
if state in ("parked", "held"):
    pass
state = "dead"
ParkedTask(task_id="x", state="held")
counts = {"in_flight": 1}
ok = entry.state is EntryState.IN_FLIGHT
'''
    assert sorted(line for line, _ in offences(source)) == [3, 4, 6, 8, 10, 11]
    assert _TEMPLATE_STATE.search('{% if entry.state == "in flight" %}')
    assert _TEMPLATE_STATE.search("{% if e.state in ('parked', 'in_flight') %}")
    assert not _TEMPLATE_STATE.search("{% if in_flight %}")
