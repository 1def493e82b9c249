"""The locks say what pyproject.toml says: edit a range, then run make lock."""

from __future__ import annotations

import re
import sys

import pytest
from packaging.requirements import Requirement

from tests.helpers import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest brings tomli on Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.timeout(30)

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: What make oldest proves at the floor of its range, as README's table says.
AT_THEIR_FLOOR = ("celery", "kombu", "redis", "django", "django-celery-beat")


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def _pins(lock: str) -> dict[str, str]:
    lines = (ROOT / "constraints" / lock).read_text().splitlines()
    return {
        _name(line.split("==")[0]): line.split("==")[1].strip()
        for line in lines
        if "==" in line and not line.startswith("#")
    }


def _requirements(*extras: str) -> list[Requirement]:
    specs = list(PROJECT["dependencies"])
    for extra in extras:
        specs.extend(PROJECT["optional-dependencies"][extra])
    found = [Requirement(spec) for spec in specs]
    return [req for req in found if not req.name.startswith("celery-zdelay")]


def _floor(requirement: Requirement) -> str:
    return next(spec.version for spec in requirement.specifier if spec.operator == ">=")


def test_the_development_lock_pins_every_requirement_within_its_range() -> None:
    pins = _pins("dev.txt")
    extras = ("test", "docs", "bench", "prometheus", "django", "django-beat", "web", "otel")
    for requirement in _requirements(*extras):
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        version = pins.get(_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in the lock: run make lock"
        assert requirement.specifier.contains(version, prereleases=True), (
            f"the lock's {requirement.name} {version} is outside {requirement}: run make lock"
        )


def test_the_oldest_lock_holds_each_range_at_its_floor() -> None:
    pins = _pins("oldest-py310.txt")
    extras = ("prometheus", "django", "django-beat", "web", "otel")
    for requirement in _requirements(*extras):
        version = pins[_name(requirement.name)]
        assert requirement.specifier.contains(version), (requirement, version)
        if _name(requirement.name) in AT_THEIR_FLOOR:
            floor = _floor(requirement)
            assert version.split(".")[: len(floor.split("."))] == floor.split("."), (
                f"make oldest runs {requirement.name} {version}, not the floor of {requirement}:"
                " run make lock"
            )
