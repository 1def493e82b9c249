"""Every test carries the layer of what it uses (tests/support/layers.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import django_forks
from tests.support.layers import LAYERS, reached_names

pytestmark = pytest.mark.timeout(240)


def _starts_a_companion() -> None:
    start_companion()  # type: ignore[name-defined]  # noqa: F821  (only read, never run)


def _through_a_helper() -> None:
    _starts_a_companion()


def test_a_helper_of_a_helper_that_starts_a_process_is_followed() -> None:
    assert "start_companion" in reached_names(_through_a_helper)


def _through_a_module_of_the_test_tree() -> None:
    django_forks.run("", env={}, cwd=Path(), timeout=1)


def test_a_helper_taken_from_a_module_of_the_test_tree_is_followed() -> None:
    # django_forks.run starts the server its Django programs are forked from
    assert "Popen" in reached_names(_through_a_module_of_the_test_tree)


def test_code_outside_the_test_tree_is_not_followed() -> None:
    # pytest.fail's own body names things no test should be judged by.
    assert reached_names(pytest.fail) == set()


def test_every_collected_test_has_exactly_one_layer(request: pytest.FixtureRequest) -> None:
    for item in request.session.items:
        layers = [layer for layer in LAYERS if item.get_closest_marker(layer) is not None]
        assert len(layers) == 1, (item.nodeid, layers)


#: Run in a fresh interpreter: collect the files given and print each test
#: with the layers it is marked with, as ``-m`` sees them.
_LIST_LAYERS = """
import sys, pytest

class Listing:
    def pytest_collection_finish(self, session):
        # imported once pytest runs (it rewrites the asserts of tests/)
        from tests.support.layers import LAYERS
        for item in session.items:
            marks = [layer for layer in LAYERS if item.get_closest_marker(layer)]
            print("LAYER", item.nodeid, ",".join(marks))

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]],
                     plugins=[Listing()]))
"""


def _layers_collected(*paths: str) -> dict[str, str]:
    """Each test in *paths*, collected once in a fresh process, with its layers."""
    listing = subprocess.run(
        [sys.executable, "-c", _LIST_LAYERS, *paths],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    rows = [line.split(" ") for line in listing.splitlines() if line.startswith("LAYER ")]
    return {nodeid: marks for _, nodeid, marks in rows}


#: A file of each layer, and the layer every one of its tests must fall in.
KNOWN = {
    "tests/test_import_graph.py": "unit",
    "tests/test_cancel_reschedule.py": "store",
    "tests/companion/test_crash_recovery.py": "system",
    "tests/web/test_web_browser.py": "system",
    "tests/store/test_admin_cluster.py": "system",
}


def test_known_files_fall_in_their_layer() -> None:
    # One collection of them all, in a process of its own as make test-fast's
    # would be (a collection per layer took a minute and more on a loaded
    # machine: each pays pytest's and the package's imports).
    layers = _layers_collected(*KNOWN)
    for path in KNOWN:
        assert any(test.startswith(path + "::") for test in layers), path
    for test, marks in layers.items():
        assert marks == KNOWN[test.split("::")[0]], (test, marks)
