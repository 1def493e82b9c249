"""``apply_delayed`` on Celery tasks: the :class:`Task` base and its mixin."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import celery

from .parking import park_many, park_task
from .transparent import install
from .worker import RunHooks

__all__ = ["DelayedTaskMixin", "Task"]


class DelayedTaskMixin(RunHooks):
    """Adds :meth:`apply_delayed` to a Celery task base class.

    Put it first in the bases of your own task class::

        class BaseTask(DelayedTaskMixin, MyCompanyTask):
            ...

        app = Celery("proj", task_cls=BaseTask)
    """

    def apply_delayed(
        self,
        args: Any = None,
        kwargs: Any = None,
        *,
        countdown: Any = None,
        eta: Any = None,
        key: str | None = None,
        on_key: str | None = None,
        tags: Iterable[str] | None = None,
        jitter: Any = None,
        limit_key: str | None = None,
        max_wait: Any = None,
        max_late: Any = None,
        **options: Any,
    ) -> Any:
        """Park this call until it is due; return its ``AsyncResult`` at once.

        *countdown* is seconds from now (on the Redis clock), *eta* a
        datetime (naive means UTC, as in Celery). Every other option of
        ``apply_async`` is accepted and ends up in the parked message. Under
        ``task_always_eager`` this runs the task now, as ``apply_async`` does,
        unless a test bound the app with :mod:`celery_zdelay.testing` (the
        ``zdelay`` fixture): then it is parked, and the test releases it.

        With *key*, at most one task is parked per key, and *on_key* says
        what a call finding the key taken does: ``"keep"`` (the default:
        park nothing), ``"replace"``, ``"debounce"`` or ``"until_finished"``
        (see :doc:`/keys-and-tags`). The result returned is that of the
        task parked under the key afterwards. *tags* (strings) let
        :func:`celery_zdelay.cancel_matching` and friends find the task.

        *jitter* (seconds, at most a day, or a ``timedelta``) spreads calls
        made for one moment: the task is due at a random moment within
        *jitter* seconds after its countdown or eta, never before it; its
        ``request.eta`` is that moment.

        *limit_key* (a string such as ``"tenant:42"``) releases the task
        under the limits of that key: a ``"limit_key:<glob>"`` entry of
        ``zdelay_rate_limits`` matching it gives each distinct key a bucket
        of its own, and a backlog drains fairly between keys (see
        :doc:`/control`).

        *max_wait* (seconds, or a ``timedelta``; only with
        ``on_key="debounce"``) ends a debounce that steady calls would
        postpone for ever: the run is due at most *max_wait* after the
        first call of the burst (the call that found the key free), on the
        Redis clock, and never earlier than the debounce alone would make
        it unless the cap says so; with *jitter* too, the cap still holds
        (see :doc:`/keys-and-tags`).

        *max_late* (seconds, or a ``timedelta``) is how late after its due
        time the task may still be released; a companion that would release
        it later (after an outage, a long pause, a rate-limit backlog) does
        what ``zdelay_on_stale`` says instead: dead-letter it with reason
        ``"stale"`` (the default), drop it (cancelled, ``REVOKED``) or run it
        anyway (counted). It overrides the companions' ``zdelay_max_late``
        (see :doc:`/control`, "Stale releases").

        Raises:
            kombu.exceptions.EncodeError: an argument cannot be serialized;
                nothing was parked.
            celery_zdelay.ConfigurationError: a key or tag is not a
                non-empty string of at most 200 printable characters, the
                ``task_id=`` holds a control character (see
                :mod:`celery_zdelay.names`), *on_key* is not a mode,
                *jitter* is not a number of seconds from 0 to 86,400,
                *max_wait* is given without ``key=`` and
                ``on_key="debounce"`` or is not a number of seconds from
                0.001 to about 100 years, *max_late* is not a number of
                seconds of at least 1, or the *limit_key* breaks the rule of
                keys; nothing was parked.
            celery_zdelay.StoreUnavailableError: the store cannot be reached.

        Warns:
            celery_zdelay.UnmatchedLimitKeyWarning: no per-key limit of the
                settings matches *limit_key* (once per process per pattern).
        """
        for name, value in (
            ("key", key),
            ("on_key", on_key),
            ("tags", tags),
            ("jitter", jitter),
            ("max_wait", max_wait),
            ("max_late", max_late),
            ("limit_key", limit_key),
        ):
            if value is not None:
                options[name] = value
        return park_task(self, args, kwargs, countdown, eta, options)

    def apply_delayed_many(
        self,
        calls: Iterable[Any],
        *,
        countdown: Any = None,
        eta: Any = None,
        keys: Iterable[str | None] | None = None,
        on_key: str | None = None,
        tags: Iterable[str] | None = None,
        jitter: Any = None,
        limit_key: str | None = None,
        max_wait: Any = None,
        max_late: Any = None,
        **options: Any,
    ) -> list[Any]:
        """Park many calls of this task, all due at once; return one ``AsyncResult`` per call.

        Each item of *calls* is one call's positional arguments (a tuple or
        list) or its keyword arguments (a dict)::

            send_reminder.apply_delayed_many([(user.id,) for user in users], countdown=3600)

        Parks what as many :meth:`apply_delayed` calls with the same
        *countdown*, *eta* and options would park (each call has its own
        task id), atomically and in one Redis round trip, faster than those
        calls in a :func:`celery_zdelay.batch` (see the performance docs).
        Celery builds, routes and signals (``before_task_publish``,
        ``after_task_publish``) every message; what depends only on the
        options (execution options, routing, parent) is worked out once.
        The calls are released in the order given; with *jitter* (see
        :meth:`apply_delayed`) each call is due at its own random moment
        within *jitter* seconds after *countdown*/*eta*, which spreads a
        burst, and they are released in the order of those moments. One
        store script parks
        them all, and Redis serves no other client meanwhile: split very
        large lists (tens of thousands) into several calls. Inside
        :func:`celery_zdelay.batch` the calls join the batch. Under
        ``task_always_eager`` each call runs now, as ``apply_async`` does.
        *tags* tag every call; *keys* gives each call its key (None for
        none), with one *on_key* (and *max_wait*, for ``"debounce"``) for
        all (see :meth:`apply_delayed`); the result of a call whose key is
        taken is the owner's. *limit_key* and *max_late* apply to every call
        (see :meth:`apply_delayed`).

        Raises:
            celery_zdelay.ConfigurationError: an item is neither a tuple, list
                nor dict, ``task_id=`` was given (each call has its own),
                *jitter* is not a number of seconds from 0 to 86,400,
                *max_wait* is given without ``keys=`` and
                ``on_key="debounce"`` or is not a duration, *max_late* is not
                a number of seconds of at least 1, or the *limit_key* breaks
                the rule of keys; nothing was parked.
            kombu.exceptions.EncodeError: an argument cannot be serialized;
                nothing was parked.
            celery_zdelay.StoreUnavailableError: the store cannot be reached.
        """
        for name, value in (
            ("keys", keys),
            ("on_key", on_key),
            ("tags", tags),
            ("jitter", jitter),
            ("max_wait", max_wait),
            ("max_late", max_late),
            ("limit_key", limit_key),
        ):
            if value is not None:
                options[name] = value
        return park_many(self, calls, countdown, eta, options)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Make the app's task sender transparent (see :mod:`celery_zdelay.transparent`).

        Celery calls this when a task class is bound to its app, in producers
        and workers alike. Importing ``celery_zdelay`` already did it for
        apps created since; this covers an app created with its own
        ``fixups=`` before the import.
        """
        install(app)
        super().on_bound(app)  # type: ignore[misc]


class Task(DelayedTaskMixin, celery.Task):  # type: ignore[misc]
    """Celery's ``Task`` with :meth:`apply_delayed`.

    Use it for every task of an app::

        app = Celery("proj", task_cls="celery_zdelay:Task")
    """
