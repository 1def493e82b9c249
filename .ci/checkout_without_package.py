"""Copy the checkout, less the package, to a folder the tox tests run in.

Run from the repository root: ``python .ci/checkout_without_package.py DEST``.

The package sits at the repository root, so tests run from the checkout
would import ``./celery_zdelay`` (pytest puts the root on ``sys.path`` for
the ``tests`` package; the Celery workers the tests start run with the
root as their working directory and ``PYTHONPATH``) instead of the wheel tox
installed. In the copy there is no ``celery_zdelay`` folder, so every
process imports the installed one; ``tests/test_package_under_test.py``
checks that it did.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What the tests read: themselves, the example project, the docs they check,
#: pyproject.toml for pytest's settings, the locks tests/test_locks.py checks,
#: and the mutation tool tests/mutation/ tests.
COPIED = (
    "tests",
    "example_project",
    "docs",
    "benchmarks",
    "constraints",
    "mutation",
    "pyproject.toml",
    "README.md",
)
IGNORED = shutil.ignore_patterns("__pycache__", "_build", "*.sqlite3", ".pytest_cache")


def main(dest: str) -> None:
    target = Path(dest)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, target / name, ignore=IGNORED)
        else:
            shutil.copy2(source, target / name)
    assert not (target / "celery_zdelay").exists()


if __name__ == "__main__":
    main(sys.argv[1])
