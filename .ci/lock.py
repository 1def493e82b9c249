"""Refresh the development lock: ``make lock`` (on purpose, never on its own).

``make test`` and CI install the package's ``dev`` extra under
``constraints/dev.txt``, so the gate gives the same result today and next
month whatever is released meanwhile. This script resolves that extra afresh
in a scratch virtualenv (the newest release of everything the ranges in
pyproject.toml allow), and writes:

* ``constraints/dev.txt``: every package of that environment, pinned;
* ``constraints/matrix-py3XX.txt``, one per Python of the tox matrix: the
  ``test`` extra resolved on that Python (a newest release may have left an
  older Python behind), less the packages whose versions the tox matrix
  chooses per env (Celery's family, redis-py, Django's), so the matrix pins
  the tools and varies only what it is there to vary;
* ``constraints/oldest-py310.txt``: every range of the package's dependencies
  and feature extras at its floor (uv's lowest-direct resolution), on the
  oldest Python, with the test tools as locked: what ``make oldest`` runs on.

``make latest`` runs the core suite on what a fresh resolve gives instead, and
names the package that breaks it.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
DEV_LOCK = ROOT / "constraints" / "dev.txt"
#: The Pythons of tox's matrix, as pyenv installs them (see the Makefile).
MATRIX_PYTHONS = ("3.10", "3.11", "3.12", "3.13")

#: What tox's envs choose for themselves (tox.ini): each Celery minor brings
#: its kombu, amqp, billiard and vine; celery[redis] the redis-py it accepts;
#: Python 3.12+ gets Django 6 with the django-celery-beat that takes it.
MATRIX_VARIES = frozenset(
    {
        "amqp",
        "asgiref",
        "billiard",
        "celery",
        "cron-descriptor",
        "django",
        "django-celery-beat",
        "django-timezone-field",
        "kombu",
        "python-crontab",
        "redis",
        "sqlparse",
        "vine",
    }
)


def _name(pin: str) -> str:
    return re.sub(r"[-_.]+", "-", pin.split("==", 1)[0].strip().lower())


def matrix_lock(version: str) -> Path:
    """The tox matrix's lock for Python *version* ("3.10")."""
    return ROOT / "constraints" / f"matrix-py{version.replace('.', '')}.txt"


def pyenv_python(version: str) -> str:
    """pyenv's interpreter of *version* ("3.10"), as tox finds it."""
    found = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python"))
    if not found:
        raise SystemExit(f"no Python {version} under ~/.pyenv/versions: install it with pyenv")
    return str(found[-1])


def resolve(python: str, extra: str = "dev") -> list[str]:
    """Install ``.[extra]`` unconstrained in a scratch venv and return its pins."""
    with tempfile.TemporaryDirectory(prefix="zdelay-lock-") as scratch:
        venv = Path(scratch) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        subprocess.run([*pip, "install", "--quiet", "--upgrade", "pip"], check=True)
        subprocess.run([*pip, "install", "--quiet", f"{ROOT}[{extra}]"], check=True)
        frozen = subprocess.run(
            [*pip, "freeze", "--all"], check=True, capture_output=True, text=True
        ).stdout
    return sorted(
        (line for line in frozen.splitlines() if "==" in line and _name(line) != "celery-zdelay"),
        key=_name,
    )


#: The extras a user installs for the package's features (not the test tools):
#: their floors are proven with the runtime dependencies' by make oldest.
FEATURE_EXTRAS = ("prometheus", "django", "django-beat", "web", "otel")
OLDEST_LOCK = ROOT / "constraints" / "oldest-py310.txt"


def floors() -> list[str]:
    """The ranges a user's install resolves from: dependencies and feature extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in FEATURE_EXTRAS:
        specs.extend(project["optional-dependencies"][extra])
    return sorted(set(specs))


def lowest(python: str, tools: list[str]) -> list[str]:
    """The lowest versions of :func:`floors` that resolve together on *python*.

    uv's lowest-direct resolution: each declared range at its floor (or the
    lowest release above it that its neighbours accept), beside the test
    tools pinned as *tools* pins them, so what both pull in agrees.
    """
    direct = {_name(re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]) for spec in floors()}
    pinned = [pin for pin in tools if _name(pin) not in direct and _name(pin) not in MATRIX_VARIES]
    with tempfile.TemporaryDirectory(prefix="zdelay-lock-") as scratch:
        venv = Path(scratch) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
        subprocess.run([*pip, "install", "--quiet", "uv"], check=True)
        requirements = Path(scratch) / "floors.in"
        requirements.write_text("\n".join([*floors(), *pinned]) + "\n")
        compiled = subprocess.run(
            [
                *(str(venv / "bin" / "uv"), "pip", "compile", str(requirements), "--quiet"),
                *("--resolution", "lowest-direct", "--python", python),
                *("--no-header", "--no-annotate"),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    return sorted((line for line in compiled.splitlines() if "==" in line), key=_name)


def write(path: Path, pins: list[str], what: str, python_version: str) -> None:
    today = datetime.date.today().isoformat()
    header = [
        f"# {what}",
        f"# Made by `make lock` on {today} with Python {python_version} (Linux x86-64);",
        "# edit pyproject.toml's ranges, then run `make lock` again, never by hand.",
    ]
    path.write_text("\n".join([*header, *pins]) + "\n")


def _version(python: str) -> str:
    return subprocess.run(
        [python, "-c", "import platform; print(platform.python_version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def main() -> int:
    python = os.environ.get("PYTHON", sys.executable)
    pins = resolve(python)
    write(
        DEV_LOCK, pins, "The development lock: what make test's .venv installs.", _version(python)
    )
    print(f"{DEV_LOCK.relative_to(ROOT)}: {len(pins)} pins")
    for version in MATRIX_PYTHONS:
        interpreter = pyenv_python(version)
        pins = [pin for pin in resolve(interpreter, "test") if _name(pin) not in MATRIX_VARIES]
        path = matrix_lock(version)
        what = f"The tox matrix's lock for Python {version}: the test extra less what envs vary."
        write(path, pins, what, _version(interpreter))
        print(f"{path.relative_to(ROOT)}: {len(pins)} pins")
    interpreter = pyenv_python(MATRIX_PYTHONS[0])
    lines = matrix_lock(MATRIX_PYTHONS[0]).read_text().splitlines()
    oldest = lowest(interpreter, [line for line in lines if "==" in line])
    what = "The oldest releases pyproject.toml's ranges allow, the test tools as locked."
    write(OLDEST_LOCK, oldest, what, _version(interpreter))
    print(f"{OLDEST_LOCK.relative_to(ROOT)}: {len(oldest)} pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
