"""docs/cli.rst shows the real ``--help`` of every command, and documents every JSON field.

Each help block in the page follows a ``.. help: <command path>`` comment.
After changing the CLI, rewrite the blocks with::

    python -m tests.cli.test_cli_docs
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner

from celery_zdelay.cli import zdelay
from celery_zdelay.config import get_config
from celery_zdelay.store import Store
from tests.support.cli import run
from tests.support.store import Stock, write_heartbeat

pytestmark = pytest.mark.timeout(60)

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.rst"
#: Width the help is rendered at, in the page as in a 100-column terminal.
WIDTH = 100
#: A help block: its comment and directive, then indented (or blank) lines.
_HEAD = r"^\.\. help: {path}\n\n\.\. code-block:: text\n\n"
_BODY = r"(?:   .*\n|\n)+?(?=\S|\Z)"
_BLOCK = re.compile(_HEAD.format(path="(?P<path>[a-z ]*)") + f"(?P<body>{_BODY})", re.M)


def command_paths(
    group: click.Group = zdelay, path: tuple[str, ...] = ("zdelay",)
) -> Iterator[str]:
    """Yield ``"zdelay"``, ``"zdelay status"``, ``"zdelay dead list"``...: every command."""
    yield " ".join(path)
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from command_paths(command, (*path, name))
        else:
            yield " ".join((*path, name))


def rendered_help(path: str) -> str:
    """Return ``celery <path> --help`` as a 100-column terminal shows it."""
    app = Celery("proj")
    try:
        result = CliRunner().invoke(
            zdelay,
            [*path.split()[1:], "--help"],
            obj=CLIContext(app=app, no_color=True, workdir=None),
            prog_name="celery zdelay",
            terminal_width=WIDTH,
            catch_exceptions=False,
        )
    finally:
        app.close()
    assert result.exit_code == 0, result.output
    return "\n".join(line.rstrip() for line in result.stdout.rstrip().splitlines())


def documented_help() -> dict[str, str]:
    """Return the help blocks of the page, by command path."""
    text = PAGE.read_text()
    return {
        match["path"].strip(): "\n".join(
            line[3:].rstrip() for line in match["body"].rstrip().splitlines()
        )
        for match in _BLOCK.finditer(text)
    }


def rewrite() -> None:
    """Put the current help of every command into the page."""
    text = PAGE.read_text()
    for path in command_paths():
        body = "\n".join(f"   {line}".rstrip() for line in rendered_help(path).splitlines())
        pattern = re.compile(_HEAD.format(path=re.escape(path)) + _BODY, re.M)
        replacement = f".. help: {path}\n\n.. code-block:: text\n\n{body}\n\n"
        text, found = pattern.subn(replacement.replace("\\", "\\\\"), text)
        if not found:
            sys.exit(f"docs/cli.rst has no '.. help: {path}' block: add one")
    PAGE.write_text(text)


def test_the_page_documents_every_command() -> None:
    assert sorted(documented_help()) == sorted(command_paths())


@pytest.mark.parametrize("path", list(command_paths()))
def test_the_page_shows_the_real_help(path: str) -> None:
    assert documented_help()[path] == rendered_help(path), (
        f"docs/cli.rst is out of date for '{path}': run python -m tests.cli.test_cli_docs"
    )


def _field_paths(document: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(document, dict):
        for key, item in document.items():
            yield f"{prefix}{key}"
            yield from _field_paths(item, f"{prefix}{key}.")
    elif isinstance(document, list):
        for item in document:
            yield from _field_paths(item, prefix.rstrip(".") + "[].")


def _adopt_every_reason(app: Celery) -> str:
    """``adopt --dry-run --json`` over a queue holding a message for each reason it names."""
    record = app.tasks["tests.record"]
    record.apply_async((1,), countdown=3600)
    record.apply_async((2,))
    record.apply_async((3,), countdown=-60)
    with app.producer_or_acquire() as producer:
        producer.publish({"not": "a task"}, exchange="", routing_key="celery")
        headers = {"task": "tests.record", "id": "undecodable", "compression": "gzip"}
        producer.publish(b"not gzip", exchange="", routing_key="celery", headers=headers)
        headers = {"task": "tests.record", "id": "bad-eta", "eta": "not a time"}
        producer.publish([[], {}, {}], exchange="", routing_key="celery", headers=headers)
    output = run(app, "adopt", "--queue", "celery", "--dry-run", "--force", "--json").stdout
    (queue,) = json.loads(output)["queues"]
    every = {"bad_eta", "eta_passed", "no_eta", "not_a_task", "undecodable"}
    assert set(queue["put_back"]) == every
    return output


def test_every_json_field_is_documented(app: Celery, stocked: Stock) -> None:
    store = Store(get_config(app))
    try:
        write_heartbeat(store, "host-a:1:abcd", seen_ago_ms=0)
    finally:
        store.close()
    page = PAGE.read_text()
    documents = {
        "status": run(app, "status", "--json", "--check").stdout,
        "list": run(app, "list", "--json").stdout,
        "dead list": run(app, "dead", "list", "--json").stdout,
        "history": run(app, "history", stocked.dead, "--json").stdout,
        "adopt": _adopt_every_reason(app),
    }
    # Every list holds an entry, so the fields of its entries are checked too
    listed = {e["id"] for e in json.loads(documents["list"])["entries"]}
    assert listed == {stocked.overdue, stocked.soon, stocked.in_flight, *stocked.later}
    assert [e["id"] for e in json.loads(documents["dead list"])["entries"]] == [stocked.dead]
    assert len(json.loads(documents["status"])["companions"]) == 1
    assert json.loads(documents["history"])["events"][-1]["event"] == "dead"
    for command, output in documents.items():
        section = page.split(f".. json: {command}\n", 1)[1].split("\n.. json: ", 1)[0]
        for field in set(_field_paths(json.loads(output))):
            assert f"``{field}``" in section, f"zdelay {command} --json: {field} is undocumented"


if __name__ == "__main__":
    rewrite()
    print(f"rewrote the help blocks of {PAGE}")
