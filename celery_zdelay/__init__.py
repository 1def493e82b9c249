"""celery-zdelay: delayed Celery tasks parked in Redis, released when due.

Workers only ever receive tasks that are due now; see the documentation at
``docs/`` for how it works.
"""

from __future__ import annotations

from .errors import ConfigurationError, StoreRefusedError, StoreUnavailableError, ZDelayError
from .events import connect_receivers as _connect_events
from .fixup import install_everywhere as _install_everywhere
from .limit_keys import UnmatchedLimitKeyWarning
from .limits import pause, resume, set_concurrency, set_rate_limit
from .parking import apply_delayed, batch, send_delayed
from .revocation import connect_receivers as _connect_revocation
from .steering import (
    EntryState,
    ParkedTask,
    cancel,
    cancel_matching,
    lookup,
    reschedule,
    reschedule_matching,
)
from .task import DelayedTaskMixin, Task
from .task_history import HistoryEvent, history
from .tracing import connect_receivers as _connect_tracing
from .transparent import TransparentAMQP

__version__ = "0.1.0"

# zdelay_threshold alone makes an app transparent, and workers report a
# forgotten companion: see celery_zdelay.fixup.
_install_everywhere()
# A cancel ends REVOKED in the result backend; parked, cancelled and dead
# tasks are announced as Celery events when the app sends task events.
_connect_revocation()
_connect_events()
# Release spans, when OpenTelemetry is installed (celery_zdelay.tracing).
_connect_tracing()

__all__ = [
    "ConfigurationError",
    "DelayedTaskMixin",
    "EntryState",
    "HistoryEvent",
    "ParkedTask",
    "StoreRefusedError",
    "StoreUnavailableError",
    "Task",
    "TransparentAMQP",
    "UnmatchedLimitKeyWarning",
    "ZDelayError",
    "__version__",
    "apply_delayed",
    "batch",
    "cancel",
    "cancel_matching",
    "history",
    "lookup",
    "pause",
    "reschedule",
    "reschedule_matching",
    "resume",
    "send_delayed",
    "set_concurrency",
    "set_rate_limit",
]
