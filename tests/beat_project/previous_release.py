"""``celery -A tests.beat_project.previous_release``: rows read as the release before did.

Until issue 35 a companion stored each django-celery-beat row with source
``config`` and without the row's own name (only the schedule name, spaces
as ``_``), and sent no reading with the rows (read as 1, see
``define.lua``). This module is the test app of ``tests.project.worker_app``
with exactly that reading put back, so that an upgrade test starts from
the state such a companion leaves in Redis and serves, and sees one of
them restarted beside the new release. Everything else is this release's
code.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from celery_zdelay.periodic import django_beat, server
from celery_zdelay.periodic.definition import SOURCE_CONFIG, Definition
from tests.project.worker_app import app

__all__ = ["app"]

_read = django_beat.DjangoBeatSource._definition


def _as_before(self: django_beat.DjangoBeatSource, row: Any, name: str, known: set[str]) -> Any:
    definition = _read(self, row, name, known)
    before = replace(definition, source=SOURCE_CONFIG, display_name=None)
    return Definition.from_body(name, before.body())


django_beat.DjangoBeatSource._definition = _as_before  # type: ignore[method-assign]
server.ROWS_READING = 1  # type: ignore[misc]
