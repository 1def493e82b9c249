"""Import every module of the installed celery-zdelay: what ``make wheel-check`` runs.

Run with the Python of a clean venv that has the wheel and a RabbitMQ-only
Celery, from a folder without the checkout: ``python wheel_check.py base``
imports every module that needs nothing but the wheel's own dependencies;
``python wheel_check.py extras`` (after the extras are installed) imports
those that need one of them. A module that imports something the wheel does
not declare fails here with ``ModuleNotFoundError``, as it would in a
project that has only what celery-zdelay declares.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

#: Modules that need an extra (or pytest, which loads the plugin itself), by
#: the extra's name; every other module must import on the base install.
NEEDS_EXTRA = {
    "celery_zdelay.web.app": "web",
    "celery_zdelay.web.cli": "web",
    "celery_zdelay.web.flask": "web",
    "celery_zdelay.web.django": "django",
    "celery_zdelay.contrib.django": "django",
    "celery_zdelay.contrib.django.apps": "django",
    "celery_zdelay.contrib.django.checks": "django",
    "celery_zdelay.contrib.django.task": "django",
    "celery_zdelay.testing.pytest_plugin": "pytest",
}


def modules() -> list[str]:
    """Return every module the installed wheel has, from its files (importing nothing)."""
    spec = importlib.util.find_spec("celery_zdelay")
    if spec is None or spec.origin is None or "site-packages" not in spec.origin:
        sys.exit(f"celery_zdelay is not the installed wheel's: {spec}")
    package = Path(spec.origin).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def main(stage: str) -> None:
    if stage == "extras":
        # The Django modules read settings when imported, as in a Django project.
        from django.conf import settings

        settings.configure(
            INSTALLED_APPS=["django.contrib.auth", "django.contrib.contenttypes"],
        )
        import django

        django.setup()
    failed = []
    names = modules()
    missing = sorted(set(NEEDS_EXTRA) - set(names))
    if missing:
        sys.exit(f"NEEDS_EXTRA names modules the wheel does not have: {missing}")
    chosen = [n for n in names if (n in NEEDS_EXTRA) == (stage == "extras")]
    for name in chosen:
        try:
            importlib.import_module(name)
        except Exception as exc:  # every failure is reported, not only the first
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    for line in failed:
        print("FAILED", line)
    print(f"{stage}: imported {len(chosen) - len(failed)} of {len(chosen)} modules")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1])
