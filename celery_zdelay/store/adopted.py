"""Broker messages adopted into the store: each parked once, whatever happens to the run.

``zdelay adopt`` (:mod:`celery_zdelay.adoption`) takes ETA task messages out
of a broker queue, parks each, then acknowledges it to the broker. A run
killed between the two leaves a message parked *and* unacknowledged: the
broker gives it back, and the next run reads it again, maybe after the
companion released the parked copy. ``adopt_once.lua`` parks a message only
the first time: in the step that parks it, it remembers the message (its id
and a fingerprint of what a redelivery cannot change) in the shard's
``adopted`` set until :data:`REMEMBER_MS` after its due time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .client import store_errors
from .store import ParkRequest, Store

__all__ = [
    "ADOPTED",
    "ADOPTED_BEFORE",
    "ID_TAKEN",
    "REMEMBER_MS",
    "Adoption",
    "adopt_once",
    "adopted_among",
    "forget",
]

#: How long after its due time an adopted message is remembered: longer than
#: a broker takes to give back what a killed consumer held (RabbitMQ at once,
#: kombu's Redis transport after ``visibility_timeout``, an hour by default).
REMEMBER_MS = 7 * 24 * 3600 * 1000

#: Parked now.
ADOPTED = "adopted"
#: A copy of a message an earlier run parked: not parked again.
ADOPTED_BEFORE = "adopted_before"
#: Another entry is stored under its id: not parked, not replaced.
ID_TAKEN = "id_taken"


@dataclass(frozen=True)
class Adoption:
    """One message to adopt: the request that parks it, and its fingerprint."""

    request: ParkRequest
    #: What a redelivery of the message cannot change, hashed (no newline).
    fingerprint: str


def adopt_once(store: Store, adoptions: Sequence[Adoption], *, by: str | None = None) -> list[str]:
    """Park each of *adoptions* unless it was adopted before; return what became of each.

    :data:`ADOPTED`, :data:`ADOPTED_BEFORE` or :data:`ID_TAKEN`, in order.
    Each is one atomic script call (the record and the park together); the
    calls go in one round trip, except on a Redis Cluster. *by* goes into
    their history (parked by an ``adopted`` call).
    """
    if not adoptions:
        return []
    calls = []
    for adoption in adoptions:
        shard = store.shard_of(adoption.request.task_id)
        keys, args = store.park_arguments(shard, [adoption.request])
        history = store.history_args(shard, "adopted", by)
        calls.append(
            (
                [*keys, store.keys(shard).adopted, *history.keys],
                [*args, adoption.fingerprint, REMEMBER_MS, *history.args],
            )
        )
    # Checked before the first call: a command refused after the record is
    # written would leave a message remembered as adopted, never parked.
    store.ensure_allowed(calls[0][0][0], "adopt_once")
    with store_errors(store.url):
        if store.cluster:
            replies = [store.scripts.adopt_once(keys=k, args=a) for k, a in calls]
        else:
            with store.client.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    store.scripts.adopt_once(keys=keys, args=args, client=pipe)
                replies = pipe.execute()
    return [_outcome(int(reply[0])) for reply in replies]


def _outcome(reply: int) -> str:
    # A due time, or 0 (adopted before), or -1 (its id taken). park.lua's
    # -2 (an id stored already, held in a set not given) cannot come: an
    # id stored already is answered -1 before park.lua runs.
    if reply > 0:
        return ADOPTED
    return ADOPTED_BEFORE if reply == 0 else ID_TAKEN


def adopted_among(store: Store, messages: Sequence[tuple[str, str]]) -> list[str | None]:
    """Return, without writing, what :func:`adopt_once` would find for each of *messages*.

    *messages* are (task id, fingerprint) pairs. :data:`ADOPTED_BEFORE`,
    :data:`ID_TAKEN`, or None (it would be parked). A record past its time
    counts as forgotten, as the script counts it.
    """
    if not messages:
        return []
    now_ms = store.time_ms()
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        for task_id, fingerprint in messages:
            keys = store.keys(store.shard_of(task_id))
            pipe.zscore(keys.adopted, f"{task_id}\n{fingerprint}")
            pipe.hexists(keys.msg, task_id)
        found = pipe.execute()
    answers: list[str | None] = []
    for index in range(len(messages)):
        remembered, stored = found[2 * index], found[2 * index + 1]
        if remembered is not None and remembered > now_ms:
            answers.append(ADOPTED_BEFORE)
        elif stored:
            answers.append(ID_TAKEN)
        else:
            answers.append(None)
    return answers


def forget(store: Store, adoptions: Sequence[Adoption]) -> None:
    """Forget that *adoptions* were adopted: a next run parks them again if it reads them.

    For a message adopt parked and then could not take out of its queue (a
    consumer had it): its parked copy is withdrawn, and the message may come
    back to its queue if that consumer dies.
    """
    if not adoptions:
        return
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        for adoption in adoptions:
            keys = store.keys(store.shard_of(adoption.request.task_id))
            pipe.zrem(keys.adopted, f"{adoption.request.task_id}\n{adoption.fingerprint}")
        pipe.execute()
