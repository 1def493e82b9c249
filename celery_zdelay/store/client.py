"""The redis-py client of the store, built from the ``zdelay_*`` settings.

One URL setting picks the deployment:

- ``redis://`` / ``rediss://`` (TLS) / ``unix://``: one Redis server; when
  that server is a Redis Cluster node, the client becomes a cluster client
  (any node of the cluster will do as the URL).
- ``sentinel://host:26379;sentinel://host2:26379``: the master of a Redis
  Sentinel group, spelled as Celery spells its broker URL; the master's name
  is ``zdelay_redis_options["master_name"]``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from kombu.utils.url import maybe_sanitize_url
from redis.backoff import AbstractBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from ..config import RetryPolicy, ZDelayConfig
from ..errors import ConfigurationError, StoreRefusedError, StoreUnavailableError, ZDelayError

__all__ = [
    "StoreClient",
    "close_client",
    "make_client",
    "sanitize_url",
    "server_state",
    "store_errors",
    "translate",
]

#: Seconds to wait for a TCP connection to the store before retrying.
DEFAULT_CONNECT_TIMEOUT = 5.0
#: Seconds to wait for a reply; scripts are bounded to milliseconds.
DEFAULT_SOCKET_TIMEOUT = 10.0

#: A client of one server (standalone or Sentinel master) or of a cluster.
StoreClient = redis.Redis | RedisCluster

UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
)

#: Options that choose the deployment rather than configure connections.
_SENTINEL_OPTIONS = ("master_name", "sentinel_kwargs")
_REDIS_PY_MAJOR = int(redis.__version__.split(".")[0])


class _PolicyBackoff(AbstractBackoff):
    """The pauses of a Celery-style retry policy, for redis-py's Retry."""

    def __init__(self, policy: RetryPolicy) -> None:
        self._intervals = policy.intervals() or [0.0]

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return self._intervals[min(max(failures, 1), len(self._intervals)) - 1]


def make_client(config: ZDelayConfig) -> StoreClient:
    """Return a client of the store at ``config.redis_url``.

    Responses stay bytes: payloads are opaque and may hold any byte.

    Raises:
        StoreUnavailableError: the store could not be reached to find out
            whether it is a cluster.
        ConfigurationError: a Sentinel URL without ``master_name``.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": DEFAULT_CONNECT_TIMEOUT,
        "socket_timeout": DEFAULT_SOCKET_TIMEOUT,
    }
    if _REDIS_PY_MAJOR < 6:
        # redis-py 5 sends CLIENT SETINFO inside connect() behind a health
        # check that connects again: a server that wants a password turns its
        # NOAUTH into a RecursionError there (redis-py 6 fixed it). Without the
        # library's name and version it sends no SETINFO and the NOAUTH
        # reaches the user.
        options["lib_name"] = options["lib_version"] = None
    options.update(config.redis_options)
    options["decode_responses"] = False
    retry = Retry(_PolicyBackoff(config.retry_policy), config.retry_policy.max_retries)
    if urlsplit(config.redis_url).scheme == "sentinel":
        return _sentinel_master(config.redis_url, options, retry)
    for name in _SENTINEL_OPTIONS:
        options.pop(name, None)
    client = redis.Redis.from_url(
        config.redis_url,
        retry=retry,
        retry_on_error=list(UNAVAILABLE),
        health_check_interval=30,
        **options,
    )
    with store_errors(config.redis_url):
        cluster_enabled = client.info("cluster").get("cluster_enabled")
    if not cluster_enabled:
        return client
    close_client(client)
    # The cluster client follows MOVED/ASK itself and retries per node.
    return RedisCluster.from_url(config.redis_url, **options)


def close_client(client: StoreClient) -> None:
    """Close every connection of *client*, a client made here with a pool of its own.

    redis-py's ``close()`` alone leaves some open until the garbage collector
    finds them: before 5.1 a standalone client's pool, in every release a
    cluster client's per-node pools. (Not for a client a caller gave: its
    pool may serve others.)
    """
    client.close()
    if isinstance(client, RedisCluster):
        for node in client.get_nodes():  # type: ignore[no-untyped-call]
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
    else:
        client.connection_pool.disconnect()


def _sentinel_master(url: str, options: dict[str, Any], retry: Retry) -> redis.Redis:
    master_name = options.pop("master_name", None)
    if not master_name:
        raise ConfigurationError(
            "zdelay_redis_url is a sentinel:// URL: set zdelay_redis_options = "
            '{"master_name": "<the name Sentinel knows the master by>"}.'
        )
    sentinel_kwargs = options.pop("sentinel_kwargs", None)
    hosts = []
    password = username = None
    db = 0
    for part in url.split(";"):
        parsed = urlsplit(part.strip())
        hosts.append((parsed.hostname or "localhost", parsed.port or 26379))
        password = unquote(parsed.password) if parsed.password else password
        username = unquote(parsed.username) if parsed.username else username
        if parsed.path.strip("/").isdigit():
            db = int(parsed.path.strip("/"))
    if password is not None:
        options.setdefault("password", password)
    if username is not None:
        options.setdefault("username", username)
    # redis-py 8 annotates Sentinel, earlier releases do not: the ignore covers both.
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **options)  # type: ignore[no-untyped-call, unused-ignore]
    master: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        master_name, db=db, retry=retry, retry_on_error=list(UNAVAILABLE)
    )
    return master


def is_cluster(client: StoreClient) -> bool:
    """Return whether *client* talks to a Redis Cluster."""
    return isinstance(client, RedisCluster)


def sanitize_url(url: str) -> str:
    """Return *url* with its password hidden, for logs and messages."""
    return ";".join(str(maybe_sanitize_url(part)) for part in url.split(";"))


@contextmanager
def store_errors(url: str) -> Iterator[None]:
    """Raise redis-py's errors inside the block as celery-zdelay's own (:func:`translate`).

    Every call to the store goes through this, so producers, the companion,
    the periodic server, the CLI and the dashboard all get the same errors
    with the same explanations. Errors that are not the store's to explain
    (a WATCH that saw a change, a script's NOSCRIPT) pass unchanged.
    """
    try:
        yield
    except redis.exceptions.RedisError as exc:
        error = translate(exc, url)
        if error is None:
            raise
        raise error from exc


def translate(exc: BaseException, url: str) -> ZDelayError | None:
    """Return celery-zdelay's error for redis-py's *exc* from the store at *url*.

    Each message says what to fix: a wrong or missing password is not "check
    that Redis is running". A database number the server does not have is a
    :class:`ConfigurationError`. Returns None for errors that are no refusal
    (WATCH, NOSCRIPT, a bad argument): their callers handle them.
    """
    if isinstance(exc, redis.exceptions.AuthenticationError):
        return StoreUnavailableError(_auth_message(url, exc))
    if isinstance(exc, UNAVAILABLE):
        return StoreUnavailableError(
            f"Cannot reach the celery-zdelay store at {sanitize_url(url)}: "
            f"{str(exc).rstrip('.')}. "
            "Check that Redis is running and that zdelay_redis_url points to it; "
            "the call did not complete, and repeating it is safe."
        )
    if not isinstance(exc, redis.exceptions.ResponseError) or isinstance(
        exc, redis.exceptions.NoScriptError
    ):
        return None
    if "DB index is out of range" in str(exc):
        database = urlsplit(url).path.strip("/") or "0"
        return ConfigurationError(
            f"The store URL {sanitize_url(url)} names database {database}, which that Redis "
            "does not have (16 by default, 0 to 15; a Redis Cluster has only 0). Fix the "
            "number in zdelay_redis_url (or the broker URL it defaults to), or raise "
            "`databases` in redis.conf."
        )
    return StoreRefusedError(_refusal_message(url, exc), transient=server_state(exc) is not None)


#: Redis error replies that describe the server's state, not the command:
#: out of memory, a read-only replica, loading, failing over, busy with a
#: script, no permission. The same command succeeds once the state passes.
SERVER_STATES = (
    "OOM",
    "READONLY",
    "LOADING",
    "MASTERDOWN",
    "TRYAGAIN",
    "CLUSTERDOWN",
    "BUSY",
    "MISCONF",
    "NOAUTH",
    "NOPERM",
)
#: redis-py's classes for some of them, whatever their text.
_SERVER_STATE_CLASSES = {
    "OutOfMemoryError": "OOM",
    "ReadOnlyError": "READONLY",
    "NoPermissionError": "NOPERM",
}


_SCRIPT_ERROR = re.compile(r"@user_script: ?\d+: -([A-Z]+)")


def server_state(exc: BaseException) -> str | None:
    """The reply code (``OOM``, ``READONLY``...) when *exc* is a Redis reply about
    the server's state rather than the command, else None.

    For the store's replies and a Redis broker's alike: the message or the
    call waits for the server instead of failing for good.
    """
    if not isinstance(exc, redis.exceptions.ResponseError):
        return None
    known = _SERVER_STATE_CLASSES.get(type(exc).__name__)
    if known is not None:
        return known
    text = str(exc.args[0]) if exc.args else ""
    # redis-py prefixes pipeline errors with "Command # N (...) of pipeline caused error: ".
    text = text.rpartition("caused error: ")[2]
    # Before Redis 7, an error inside a script comes back as a plain reply
    # that quotes it: "@user_script: 467: -OOM command not allowed ...".
    quoted = _SCRIPT_ERROR.search(text)
    if quoted is not None:
        text = text[quoted.start(1) :]
    return next((code for code in SERVER_STATES if text.startswith(code)), None)


def _refusal_message(url: str, exc: Exception) -> str:
    where = f"The celery-zdelay store at {sanitize_url(url)}"
    text = str(exc).rstrip(".")
    state = server_state(exc)
    if state == "OOM":
        fix = (
            "is out of memory (maxmemory reached under noeviction) and refused the write. "
            "Raise maxmemory, free memory, or give celery-zdelay its own instance"
        )
    elif state == "READONLY":
        fix = (
            "is a read-only replica and refused the write. Point zdelay_redis_url at "
            "the primary (or use a sentinel:// URL, which follows failovers)"
        )
    elif state == "NOPERM":
        fix = (
            "refused the write: its ACL user lacks a command or key it needs. Give the "
            "user the ACL rule of its role (producer, companion, dashboard) listed under "
            '"Redis ACL" in the deployment docs'
        )
    elif state == "BUSY":
        fix = (
            "is busy running a script longer than busy-reply-threshold and refused the "
            "call until it ends. Wait, or stop the script (SCRIPT KILL, FUNCTION KILL)"
        )
    elif state is not None:
        fix = "refused the write for now; repeat the call once the server recovers"
    else:
        fix = "refused the write"
    return f"{where} {fix}; nothing was written. Redis said: {text}."


def _auth_message(url: str, exc: Exception) -> str:
    where = f"The celery-zdelay store at {sanitize_url(url)}"
    text = str(exc)
    if "invalid username-password pair" in text or "WRONGPASS" in text:
        return (
            f"{where} refused the password: the username or password in zdelay_redis_url "
            "(or zdelay_redis_options) is wrong, or the ACL user is disabled."
        )
    if "NOAUTH" in text or "HELLO must be called" in text or "Authentication required" in text:
        return (
            f"{where} requires a password, and none is given: put it in the URL "
            "(redis://:PASSWORD@host:6379/0, or redis://USER:PASSWORD@... for an ACL "
            'user) or in zdelay_redis_options = {"password": ...}.'
        )
    return f"{where} refused to authenticate: {text.rstrip('.')}."
