"""``apply_delayed_on_commit``: park a task when the transaction commits.

A task that refers to rows written in the current transaction must not be
parked before they are committed: on rollback it would act on rows that never
existed, and parked before the commit it could even run first. Django's
``transaction.on_commit`` solves that, and Celery's ``DjangoTask`` wraps
``delay``/``apply_async`` in it, but returns None (celery#8976), so the caller
cannot keep the task id, say to cancel the task later. Here the id is chosen
at call time and the ``AsyncResult`` returned at once; the task is parked
with that id when the transaction commits, and never if it rolls back.
"""

from __future__ import annotations

import functools
from typing import Any

import celery
from celery.utils import uuid
from django.db import transaction

from ...config import get_config
from ...keys import check_task_id, set_headers, task_id_for
from ...task import DelayedTaskMixin

__all__ = ["Task"]

try:
    from celery.contrib.django.task import DjangoTask
except ImportError:  # Celery < 5.4 has no DjangoTask: the same two methods.

    class DjangoTask(celery.Task):  # type: ignore[misc,no-redef]
        """``delay_on_commit`` and ``apply_async_on_commit`` as Celery 5.4 has them."""

        def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
            transaction.on_commit(functools.partial(self.delay, *args, **kwargs))

        def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
            transaction.on_commit(functools.partial(self.apply_async, *args, **kwargs))


class Task(DelayedTaskMixin, DjangoTask):  # type: ignore[misc]
    """Celery's ``DjangoTask`` with :meth:`apply_delayed` and :meth:`apply_delayed_on_commit`.

    ``delay_on_commit`` and ``apply_async_on_commit`` work as in Celery.
    Use it for every task of the app::

        app = Celery("proj", task_cls="celery_zdelay.contrib.django:Task")
    """

    def apply_delayed_on_commit(
        self,
        args: Any = None,
        kwargs: Any = None,
        *,
        countdown: Any = None,
        eta: Any = None,
        using: str | None = None,
        robust: bool = False,
        **options: Any,
    ) -> Any:
        """Park this call when the current transaction commits; return its result now.

        The returned ``AsyncResult`` carries the id the task is parked with,
        so it can be stored and later passed to :func:`celery_zdelay.cancel`.
        If the transaction rolls back, nothing is parked and the id stays
        unknown to Celery. Outside a transaction the task is parked at once.

        *countdown* counts from the commit, as with ``apply_async_on_commit``;
        pass *eta* for a due time that does not depend on when the commit
        happens. *using* names the database whose transaction to follow
        (default: ``"default"``). Every other option is passed to
        :meth:`apply_delayed`, and from there to ``apply_async``.

        An error while parking (e.g. ``StoreUnavailableError``) is raised
        where the transaction commits, after the data is committed; with
        ``robust=True`` Django logs it instead (``django.db.backends.base``)
        and the commit's other callbacks still run.
        """
        key = options.get("key")
        # Bad input raises here, inside the transaction: at the commit, the
        # rows would already be committed (and, robust, the error only logged).
        set_headers({}, key, options.get("on_key"), options.get("tags"), options.get("max_wait"))
        task_id = options.pop("task_id", None) or _new_task_id(self, key)
        if key is not None:
            check_task_id(str(task_id), key, get_config(self._get_app()).shards)

        def park() -> None:
            self.apply_delayed(
                args, kwargs, countdown=countdown, eta=eta, task_id=task_id, **options
            )

        # Django names the callback when it logs a failure (robust=True).
        park.__qualname__ = f"{self.name}[{task_id}].apply_delayed_on_commit"
        transaction.on_commit(park, using=using, robust=robust)
        return self.AsyncResult(task_id)


def _new_task_id(task: Any, key: Any) -> str:
    """A new task id; for a key, one on the key's shard (see :mod:`celery_zdelay.keys`)."""
    if isinstance(key, str) and key:
        return task_id_for(key, get_config(task._get_app()).shards)
    return str(uuid())
