"""Run Celery's own integration tests that send delayed work, with transparent mode on.

``make celery-suite`` runs ``python .ci/celery_suite.py``: it takes
``t/integration`` from the sdist of the installed Celery (downloaded once,
kept in the venv), starts a private redis-server (the broker, the result
backend and celery-zdelay's store) and a companion (``celery -A
celery_suite_app zdelay``), and runs the delayed-work subset (see
``celery_suite_plugin.py``) with ``zdelay_threshold = 0``: every message
with an ETA is parked and released by the companion. Celery's session
worker (prefork) runs the tasks. It passes as it does on Celery alone,
which ``--mode native`` runs (no companion, celery_zdelay never imported).

Extra arguments go to pytest (``-k test_eta``, ``-x``...).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import celery

from celery_zdelay.testing import RedisServer

CI = Path(__file__).resolve().parent
ROOT = CI.parent
#: The suite's files that hold tests sending delayed work.
FILES = [
    "t/integration/test_tasks.py",
    "t/integration/test_canvas.py",
    "t/integration/test_group_chains.py",
    "t/integration/test_inspect.py",
    "t/integration/test_worker.py",
]
#: The whole run, bounded (CI's budget for this job is 8 minutes).
RUN_SECONDS = 420
COMPANION_START_SECONDS = 60


def sdist() -> Path:
    """Return the extracted sdist of the installed Celery, downloading it once."""
    version = celery.__version__
    cache = Path(sys.prefix) / "celery-sdist"
    tree = cache / f"celery-{version}"
    if (tree / "t" / "integration").is_dir():
        return tree
    cache.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"celery=={version}",
                "--dest",
                download,
            ],
            check=True,
        )
        (archive,) = Path(download).glob("celery-*.tar.gz")
        with tarfile.open(archive) as tar:
            # Only the tests and pytest's settings: the sdist's own celery/
            # folder would shadow the installed Celery, the one under test.
            members = [
                m for m in tar.getmembers() if m.name.split("/")[1:2] in (["t"], ["pyproject.toml"])
            ]
            tar.extractall(cache, members=members, filter="data")
    return tree


def start_companion(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = log.open("wb")
    companion = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celery_suite_app", "zdelay", "-l", "INFO"],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=CI,
    )
    deadline = time.monotonic() + COMPANION_START_SECONDS
    while b" started: " not in log.read_bytes():
        if companion.poll() is not None or time.monotonic() > deadline:
            companion.kill()
            sys.exit(f"the companion did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return companion


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["zdelay", "native"], default="zdelay")
    args, pytest_args = parser.parse_known_args()
    tree = sdist()
    overrides = tree / "integration-tests-config.json"
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "TEST_BROKER": f"{server.url}/0",
            "TEST_BACKEND": f"{server.url}/1",
            "REDIS_HOST": "127.0.0.1",
            "REDIS_PORT": str(server.port),
            "ZDELAY_SUITE": args.mode,
            "PYTHONPATH": os.pathsep.join([str(CI), str(tree)]),
            # test_run_worker starts the `celery` command of this venv.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        }
        command = [
            sys.executable,
            "-m",
            "pytest",
            *FILES,
            "-p",
            "celery.contrib.pytest",
            "-p",
            "celery_suite_plugin",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-q",
            "-rfEs",
            "--timeout",
            "120",
            *pytest_args,
        ]
        companion = None
        if args.mode == "zdelay":
            # Celery's own way to configure its suite: keys merged into celery_config.
            overrides.write_text(json.dumps({"zdelay_threshold": 0}))
            companion = start_companion(env, Path(tmp) / "companion.log")
        else:
            overrides.unlink(missing_ok=True)
            command += ["-p", "no:celery_zdelay"]
        try:
            run = subprocess.run(command, env=env, cwd=tree, timeout=RUN_SECONDS, check=False)
        finally:
            if companion is not None:
                companion.terminate()
                companion.wait(timeout=30)
            overrides.unlink(missing_ok=True)
        if companion is None:
            return run.returncode
        # Passing proves nothing unless the delayed work went through the
        # companion: it logs how many tasks it released when it stops.
        log = (Path(tmp) / "companion.log").read_text()
        released = re.findall(r"stopped after releasing (\d+) tasks", log)
        print(f"the companion released {released[-1] if released else 'no'} tasks")
        if not released or int(released[-1]) == 0:
            print(log[-4000:])
            return run.returncode or 1
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
