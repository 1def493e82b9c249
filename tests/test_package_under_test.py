"""Given the tests run, when they and the Celery processes they start import
celery_zdelay, then both get the same copy — and under tox, the installed
wheel, not the checkout's ``celery_zdelay/`` folder.

tox sets ``ZDELAY_TEST_INSTALLED=1`` and runs the tests from a copy of the
checkout without the package (``.ci/checkout_without_package.py``): with the
package at the repository root, tests run from the checkout would import
``./celery_zdelay`` and prove nothing about the wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from celery import Celery

import celery_zdelay
from tests.helpers import ROOT, CeleryProcess


def _imported_by_a_celery_process(app: Celery) -> Path:
    """Where a process started as the tests start workers imports celery_zdelay from."""
    env = CeleryProcess(app, "worker").env
    out = subprocess.run(
        [sys.executable, "-c", "import celery_zdelay; print(celery_zdelay.__file__)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return Path(out.strip()).resolve()


def test_workers_import_the_same_celery_zdelay_as_the_tests(app: Celery) -> None:
    here = Path(celery_zdelay.__file__).resolve()
    assert _imported_by_a_celery_process(app) == here


def test_under_tox_the_installed_wheel_is_tested(app: Celery) -> None:
    here = Path(celery_zdelay.__file__).resolve()
    if os.environ.get("ZDELAY_TEST_INSTALLED") != "1":
        # make test: the editable install points at the checkout itself.
        assert here.parent == ROOT / "celery_zdelay"
        return
    installed = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    for imported in (here, _imported_by_a_celery_process(app)):
        assert any(imported.is_relative_to(folder) for folder in installed), (
            f"celery_zdelay was imported from {imported}, not from the installed "
            f"wheel in {sorted(map(str, installed))}"
        )
    assert not (ROOT / "celery_zdelay").exists(), "tox must run the tests without the package"
