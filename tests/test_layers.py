"""Every test carries the layer of what it uses (tests/support/layers.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.layers import LAYERS, reached_names

pytestmark = pytest.mark.timeout(240)


def _starts_a_companion() -> None:
    start_companion()  # type: ignore[name-defined]  # noqa: F821  (only read, never run)


def _through_a_helper() -> None:
    _starts_a_companion()


def test_a_helper_of_a_helper_that_starts_a_process_is_followed() -> None:
    assert "start_companion" in reached_names(_through_a_helper)


def test_code_outside_the_test_tree_is_not_followed() -> None:
    # pytest.fail's own body names things no test should be judged by.
    assert reached_names(pytest.fail) == set()


def test_every_collected_test_has_exactly_one_layer(request: pytest.FixtureRequest) -> None:
    for item in request.session.items:
        layers = [layer for layer in LAYERS if item.get_closest_marker(layer) is not None]
        assert len(layers) == 1, (item.nodeid, layers)


def _collected(*args: str) -> set[str]:
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return {line for line in listing.splitlines() if "::" in line}


#: A file of each layer, and the layer every one of its tests must fall in.
KNOWN = {
    "tests/test_import_graph.py": "unit",
    "tests/test_cancel_reschedule.py": "store",
    "tests/companion/test_crash_recovery.py": "system",
    "tests/web/test_web_browser.py": "system",
    "tests/store/test_admin_cluster.py": "system",
}


def test_known_files_fall_in_their_layer() -> None:
    # One collection of them all, then one per layer (each pays pytest's and
    # the package's imports: a collection per file and layer took minutes).
    every = _collected(*KNOWN)
    for path in KNOWN:
        assert any(test.startswith(path + "::") for test in every), path
    for layer in sorted(set(KNOWN.values())):
        expected = {test for test in every if KNOWN[test.split("::")[0]] == layer}
        assert _collected("-m", layer, *KNOWN) == expected, layer
