"""Python mutants through cosmic-ray: one session per module, its own tests each.

cosmic-ray changes the module on disk (here: in the scratch copy), runs a
command, and puts the module back: the only way of mutating that the
tests' subprocesses (workers, companions) see too. Its operators are
filtered down to one mutant per place, the way mutmut mutates: each
comparison to its boundary or its opposite, each arithmetic operator to
its inverse, each number moved by one, each ``and``/``or``, ``True``/``False``,
``break``/``continue`` swapped, each condition negated, each ``except``
made to catch nothing, each decorator removed, each ``for`` loop emptied.
"""

from __future__ import annotations

import ast
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from cosmic_ray.work_db import WorkDB, use_db  # type: ignore[import-untyped]
from cosmic_ray.work_item import WorkerOutcome, WorkResult  # type: ignore[import-untyped]

from .run import pytest_command
from .targets import Target
from .tree import test_env

__all__ = ["KEPT_OPERATORS", "records_of", "run_module"]

KEPT_OPERATORS = (
    *(
        f"core/ReplaceComparisonOperator_{a}_{b}"
        for a, b in (
            ("Eq", "NotEq"),
            ("NotEq", "Eq"),
            ("Lt", "LtE"),
            ("LtE", "Lt"),
            ("Gt", "GtE"),
            ("GtE", "Gt"),
            ("Is", "IsNot"),
            ("IsNot", "Is"),
            ("In", "NotIn"),
            ("NotIn", "In"),
        )
    ),
    *(
        f"core/ReplaceBinaryOperator_{a}_{b}"
        for a, b in (
            ("Add", "Sub"),
            ("Sub", "Add"),
            ("Mul", "Div"),
            ("Div", "Mul"),
            ("FloorDiv", "Mul"),
            ("Mod", "Mul"),
            ("Pow", "Mul"),
            ("BitOr", "BitAnd"),
            ("BitAnd", "BitOr"),
            ("LShift", "RShift"),
            ("RShift", "LShift"),
        )
    ),
    "core/ReplaceUnaryOperator_Delete_Not",
    "core/ReplaceUnaryOperator_USub_UAdd",
    "core/AddNot",
    "core/ReplaceTrueWithFalse",
    "core/ReplaceFalseWithTrue",
    "core/ReplaceAndWithOr",
    "core/ReplaceOrWithAnd",
    "core/ReplaceBreakWithContinue",
    "core/ReplaceContinueWithBreak",
    "core/ExceptionReplacer",
    "core/NumberReplacer",
    "core/RemoveDecorator",
    "core/ZeroIterationForLoop",
)


def _config(target: Target, timeout_s: float) -> str:
    # cosmic-ray skips an operator whose name a pattern matches (re.match):
    # one pattern that matches every name but the kept ones.
    kept = "|".join(name.replace("/", "/") for name in KEPT_OPERATORS)
    command = shlex.join(pytest_command(target.tests))
    return (
        "[cosmic-ray]\n"
        f"module-path = {json.dumps(target.path)}\n"
        f"timeout = {timeout_s:.0f}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n\n"
        "[cosmic-ray.distributor]\n"
        'name = "local"\n\n'
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = [{json.dumps(f'(?!(?:{kept})$)')}]\n"
    )


Span = tuple[tuple[int, int], tuple[int, int]]


def _annotation_spans(module: Path) -> list[Span]:
    """The (start, end) positions of every type annotation in *module*."""
    spans: list[Span] = []
    for node in ast.walk(ast.parse(module.read_text())):
        annotation: ast.expr | None = None
        if isinstance(node, (ast.arg, ast.AnnAssign)):
            annotation = node.annotation
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            annotation = node.returns
        if annotation is not None and annotation.end_lineno is not None:
            end_col = annotation.end_col_offset or 0
            start = (annotation.lineno, annotation.col_offset)
            spans.append((start, (annotation.end_lineno, end_col)))
    return spans


def _within(position: tuple[int, int], span: Span) -> bool:
    return span[0] <= tuple(position) < span[1]


def _skip_annotations(module: Path, session: Path) -> None:
    """Skip mutants inside annotations: with ``from __future__ import annotations``
    (every module here) they are never evaluated, so those mutants are
    equivalent by construction and would only lower the kill rate."""
    spans = _annotation_spans(module)
    with use_db(str(session), WorkDB.Mode.open) as work_db:
        for item in list(work_db.pending_work_items):
            mutation = item.mutations[0]
            if any(_within(mutation.start_pos, span) for span in spans):
                work_db.set_result(
                    item.job_id,
                    WorkResult(output="In an annotation", worker_outcome=WorkerOutcome.SKIPPED),
                )


def _cli(tree: Path, *args: str) -> str:
    bin_dir = Path(sys.executable).parent
    done = subprocess.run(
        [str(bin_dir / args[0]), *args[1:]],
        cwd=tree,
        env=test_env(tree),
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


def run_module(target: Target, tree: Path, *, timeout_s: float) -> list[dict[str, Any]]:
    """Mutate *target* in *tree* and run its tests against each mutant; one record each."""
    session = tree / f"{target.name}.sqlite"
    config = tree / f"{target.name}.toml"
    config.write_text(_config(target, timeout_s))
    session.unlink(missing_ok=True)
    _cli(tree, "cosmic-ray", "init", str(config), str(session))
    _cli(tree, "cr-filter-operators", str(session), str(config))
    _cli(tree, "cr-filter-pragma", str(session))
    _skip_annotations(tree / target.path, session)
    _cli(tree, "cosmic-ray", "exec", str(config), str(session))
    return records_of(target, tree, session)


def records_of(target: Target, tree: Path, session: Path) -> list[dict[str, Any]]:
    """One record per mutant cosmic-ray has run in *session* (also of a run cut short)."""
    records = []
    for line in _cli(tree, "cosmic-ray", "dump", str(session)).splitlines():
        item, result = json.loads(line)
        if result is None or result.get("worker_outcome") == "skipped":
            continue
        mutation = item["mutations"][0]
        outcome = result.get("test_outcome")
        records.append(
            {
                "target": target.name,
                "path": target.path,
                "line": mutation["start_pos"][0],
                "kind": mutation["operator_name"].removeprefix("core/"),
                "description": f"{mutation['operator_name']} #{mutation['occurrence']}",
                # "incompetent": cosmic-ray could not make this mutant (it
                # raised while rewriting the module); not a mutant, not counted.
                "killed": None if outcome == "incompetent" else outcome != "survived",
                "outcome": outcome or result.get("worker_outcome"),
                "diff": result.get("diff") or "",
            }
        )
    return records
