"""A headless Chromium for the dashboard, Flower and trace tests, and the page an operator uses.

The browser is Debian's ``chromium`` (``make install`` installs it), driven by
Playwright's Python package through ``executable_path``: Playwright never
downloads a browser of its own here.

Loaded as a pytest plugin (``tests/conftest.py``): a test asks for ``page``
(or ``browser``); a module overrides ``viewport`` for another page size, or
``browser`` for a Chromium started with other arguments.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "CHROMIUM_ARGS",
    "SCREENSHOTS",
    "broken_words",
    "browser",
    "chromium",
    "chromium_path",
    "operator_page",
    "page",
    "screenshot",
    "viewport",
]

CHROMIUM = os.environ.get("ZDELAY_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: Set to a directory (e.g. docs/_static) to keep the screenshots the tests take.
SCREENSHOTS = os.environ.get("ZDELAY_WEB_SCREENSHOTS")
#: How long a page action or wait may take before the test fails (a loaded CI machine).
PAGE_TIMEOUT_MS = 20_000


def chromium_path() -> str:
    """Return the system Chromium, failing (never skipping) when it is missing."""
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        raise AssertionError(
            f"{CHROMIUM} is missing: run make install (it runs apt-get install -y chromium)."
        )
    return CHROMIUM if Path(CHROMIUM).exists() else str(shutil.which("chromium"))


@contextmanager
def chromium(*args: str) -> Iterator[Any]:
    """A headless Chromium launched by Playwright with CHROMIUM_ARGS and *args*."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=chromium_path(), headless=True, args=[*CHROMIUM_ARGS, *args]
        )
        try:
            yield launched
        finally:
            launched.close()


@contextmanager
def operator_page(browser: Any, **context_options: Any) -> Iterator[Any]:
    """A page in a browser context of its own (its own cookies), as an operator uses it.

    Page actions wait up to PAGE_TIMEOUT_MS, and the confirmation dialogs of
    the action buttons are accepted: the operator says yes.
    """
    context = browser.new_context(**context_options)
    try:
        opened = context.new_page()
        opened.set_default_timeout(PAGE_TIMEOUT_MS)
        opened.on("dialog", lambda dialog: dialog.accept())
        yield opened
    finally:
        context.close()


#: Words of table cells broken across two lines: a word's characters whose
#: boxes sit on more than one line. Words are the parts between spaces and
#: hyphens (a line may end after a hyphen); one longer than 24 characters (an
#: id, a long repr) may break. Words of <code> are left out unless asked for;
#: there the parts of a name or an id (between ``_ : . /`` too) are words.
_BROKEN_WORDS = """(inCode) => {
    const broken = [];
    for (const cell of document.querySelectorAll('td, th')) {
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            const code = node.parentElement.closest('code');
            if (code && !inCode) continue;
            const words = code ? /[^\\s\\-_:.\\/]+/g : /[^\\s\\-]+/g;
            for (const word of node.data.matchAll(words)) {
                if (word[0].length > 24) continue;  // an id may break; a word must not
                const range = document.createRange();
                range.setStart(node, word.index);
                range.setEnd(node, word.index + word[0].length);
                const tops = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
                if (tops.size > 1) broken.push(word[0]);
            }
        }
    }
    return broken;
}"""


def broken_words(page: Any, *, in_code: bool = False) -> list[str]:
    """Return the words of the page's table cells that a line break cuts in two.

    With *in_code*, the words of ``<code>`` too (arguments, names, ids): a
    word up to 24 characters long stays whole there as well.
    """
    broken: list[str] = page.evaluate(_BROKEN_WORDS, in_code)
    return broken


def screenshot(page: Any, name: str, tmp_path: Path) -> Path:
    """Take a screenshot of the viewport; keep it in SCREENSHOTS when that is set."""
    target = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    target.mkdir(parents=True, exist_ok=True)
    path = target / name
    for attempt in range(3):
        try:
            page.screenshot(path=str(path))
            break
        except Exception as exc:  # Chromium under load: "Unable to capture screenshot"
            if attempt == 2 or "Unable to capture screenshot" not in str(exc):
                raise
            page.wait_for_timeout(500)
    assert path.stat().st_size > 1000
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for the module's tests (each page has a context of its own)."""
    with chromium() as launched:
        yield launched


@pytest.fixture
def viewport() -> dict[str, int]:
    """The size of ``page``; a module overrides it for its screenshots."""
    return {"width": 1280, "height": 900}


@pytest.fixture
def page(browser: Any, viewport: dict[str, int]) -> Iterator[Any]:
    """An operator's page, in Paris time, so times shown are checked off UTC."""
    with operator_page(browser, viewport=viewport, timezone_id="Europe/Paris") as opened:
        yield opened
