"""A scratch copy of the tree for mutants, so the working tree is never changed.

The tests start workers and companions as subprocesses with
``PYTHONPATH`` set to the tree they run from, so running the tests from
the copy (with the copy first on ``PYTHONPATH``) makes every process,
the pytest one included, import the mutated code and read the mutated
Lua.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["ROOT", "copy_tree", "test_env"]

ROOT = Path(__file__).resolve().parent.parent
_COPIED = ("celery_zdelay", "tests", "example_project", "pyproject.toml", "README.md", "docs")
_SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc", "_build", ".pytest_cache")


def copy_tree(into: Path) -> Path:
    """Copy what the tests need into *into* (emptied first); return it."""
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    for name in _COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=_SKIPPED)
        elif source.exists():
            shutil.copy2(source, into / name)
    return into


def test_env(tree: Path) -> dict[str, str]:
    """The environment the tests of a mutant run with: *tree* imported first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    # A fresh .pyc written within the same second as the mutated source could
    # be taken for the source: never write them.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env
