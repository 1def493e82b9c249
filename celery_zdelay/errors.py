"""Errors raised by celery-zdelay.

Every error derives from :class:`ZDelayError`, and every message says what to
do about it.
"""

from __future__ import annotations

__all__ = [
    "BrokerUnavailableError",
    "ConfigurationError",
    "EntryError",
    "QueueInUseError",
    "QueueNotFoundError",
    "StoreRefusedError",
    "StoreUnavailableError",
    "ZDelayError",
]


class ZDelayError(Exception):
    """Raised for every celery-zdelay failure; the base of the others."""

    #: Whether the store's state, not the call, is at fault: the same call
    #: succeeds once the store is back (reachable, loaded, done with a busy
    #: script, promoted, given memory or rights). A caller that can wait,
    #: such as the companion, waits; one that cannot reports the message.
    transient = False


class ConfigurationError(ZDelayError, ValueError):
    """Raised when a ``zdelay_*`` setting or an argument is invalid.

    The message names the setting or argument and the accepted values.
    """


class StoreUnavailableError(ZDelayError, ConnectionError):
    """Raised when the Redis store cannot be reached after the retry policy.

    Nothing was parked (or changed) by the call that raised it. The message
    names the store URL with its password hidden.
    """

    transient = True


class StoreRefusedError(ZDelayError):
    """Raised when the store answers but refuses to park.

    Out of memory, a read-only replica, an ACL user without the right, or a
    key under the prefix that another program made of another type. Nothing
    of the refused call was written (on a Redis Cluster: nothing of the
    refused shard's part). The message says what to fix. :attr:`transient`
    is set when the refusal is the server's state (out of memory, read-only,
    busy, no permission), not the call's (a key of another type).
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class EntryError(ZDelayError):
    """Raised when a parked entry cannot be read or published.

    The companion catches it and moves the entry to the dead-letter set with
    :attr:`reason`; it reaches users only from inspection helpers.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BrokerUnavailableError(ZDelayError, ConnectionError):
    """Raised when ``zdelay adopt`` cannot reach the broker, or loses it midway.

    The message names the broker URL with its password hidden and says what
    became of the messages taken so far.
    """

    transient = True


class QueueNotFoundError(ZDelayError):
    """Raised when ``zdelay adopt`` is given a queue that neither the broker nor the app knows.

    Nothing was taken from any queue.
    """


class QueueInUseError(ZDelayError):
    """Raised when ``zdelay adopt`` finds a worker consuming a queue it was given.

    A running worker holds the ETA messages it took in memory, unacknowledged;
    adopting what it left in the queue would split them. Nothing was taken
    from any queue; the message names the workers to stop.
    """
