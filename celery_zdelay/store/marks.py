"""The keys and tags of parked entries, in the store: written, read, checked and repaired.

Each shard has two more keys (see :class:`~celery_zdelay.store.redis_keys.ShardKeys`):
``marks``, a hash of each marked entry's record (``i:<id>``; ``d:<id>`` while
it is dead-lettered) and of each key's owner (``k:<key>``), and ``tagged``,
a sorted set of ``<tag>\\n<id>`` read by lexical range. ``park_keyed.lua``
writes them with the entry; every script that removes an entry (handoff,
push, ack, cancel, dead-letter, purge, requeue) updates them in the same
step (``lua/_marks.lua``), as ``park.lua`` does for an id parked again,
and checks once per call whether the shard has any marks at all, so
unmarked shards pay one ``EXISTS``.

A key lives on the shard of its entry: a keyed entry's id is drawn to fall
on its key's shard (:func:`celery_zdelay.keys.task_id_for`), so one script
sees every entry of a key, and lookups by id still find it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from redis.exceptions import WatchError

from ..entry import decode_entry
from ..errors import EntryError
from .client import store_errors
from .headers import TAGS_HEADER
from .store import Store

__all__ = [
    "CHECK_SAMPLE",
    "ON_KEY_MODES",
    "EntryMarks",
    "Mark",
    "MarkProblem",
    "check_marks",
    "finish_key",
    "key_owner",
    "mark_records",
    "marks_of",
    "repair_marks",
    "signed_with_tag",
    "start_run",
    "tag_count",
    "tagged_ids",
]

#: The modes of ``on_key``, and their letter in the store's records.
ON_KEY_MODES: Mapping[str, str] = {
    "keep": "k",
    "replace": "r",
    "debounce": "d",
    "until_finished": "u",
}
#: Mode letters of a record, back to the names of ``on_key``.
_MODES = {letter: mode for mode, letter in ON_KEY_MODES.items()}
#: Members read per round trip when listing a tag or checking a shard.
_PAGE = 1000
#: Index records and tag members ``zdelay status --check`` reads per shard at
#: most (a random sample above it; ``zdelay repair`` reads them all).
CHECK_SAMPLE = 1000


@dataclass(frozen=True)
class Mark:
    """The key (with its mode) and tags of one entry to park (checked by the producer).

    Built by :func:`celery_zdelay.keys.mark_from_headers`; written by
    ``park_keyed.lua`` as :meth:`record`, read back by :func:`parse_record`.
    """

    key: str | None
    on_key: str
    tags: tuple[str, ...]
    #: How long an ``until_finished`` key stays taken after the release, at most
    #: (stored as the digits after the mode: the record's format is unchanged).
    max_run_ms: int
    #: ``debounce`` only: the key's burst of calls runs at most this long
    #: after its first call (``max_wait=``, in ms); None for no cap.
    max_wait_ms: int | None = None

    def record(self) -> str:
        """The store's record of this mark (see ``lua/_marks.lua``).

        A ``max_wait`` travels as the head's ``w`` field; ``park_keyed.lua``
        adds the burst's first call (``f``) on the Redis clock.
        """
        mode = ON_KEY_MODES[self.on_key] if self.key is not None else "-"
        head = f"{mode}{self.max_run_ms}"
        if self.max_wait_ms is not None and self.key is not None:
            head += f" w{self.max_wait_ms}"
        return "\n".join([head, self.key or "", *self.tags])


@dataclass(frozen=True)
class EntryMarks:
    """The key and tags recorded for one entry."""

    key: str | None
    on_key: str | None
    tags: tuple[str, ...]


@dataclass(frozen=True)
class MarkProblem:
    """One way a shard's index disagrees with its entries (``zdelay status --check``)."""

    shard: int
    kind: str
    detail: str
    #: The writes that fix it: ("hdel", marks field), ("zrem"/"zadd", tagged member).
    fixes: tuple[tuple[str, str], ...] = ()


# -- workers ----------------------------------------------------------------------


def finish_key(store: Store, key: str, task_id: str) -> bool:
    """Free *key* after task *task_id* (``until_finished``) ran; return whether it held it."""
    keys = store.keys(store.shard_of(key))
    with store_errors(store.url):
        return bool(
            store.scripts.finish_key(
                keys=[keys.marks, keys.due, keys.lease, keys.msg], args=[key, task_id]
            )
        )


def start_run(
    store: Store, key: str, task_id: str, *, max_run_ms: int, policy: str
) -> tuple[str, str | None]:
    """Take *key* for the run of *task_id* about to start, unless another run owns it.

    Returns ("run", None), or ("wait", owner) / ("skip", owner) while
    *owner* runs (see ``lua/start_run.lua``). The key is freed as an
    ``until_finished`` key is (:func:`finish_key`), or when *max_run_ms* passed.
    """
    keys = store.keys(store.shard_of(key))
    with store_errors(store.url):
        reply = store.scripts.start_run(keys=[keys.marks], args=[key, task_id, max_run_ms, policy])
    verdict = _text(reply[0])
    return verdict, (_text(reply[1]) if len(reply) > 1 else None)


# -- readers -----------------------------------------------------------------------


def tagged_ids(store: Store, tag: str, *, shards: Iterable[int] | None = None) -> list[str]:
    """Return the ids of the entries tagged *tag* (parked or in flight), shard by shard."""
    low, high = b"[" + tag.encode() + b"\n", b"(" + tag.encode() + b"\x0b"
    found: list[str] = []
    for shard in store.shards if shards is None else shards:
        key = store.keys(shard).tagged
        offset = 0
        while True:
            with store_errors(store.url):
                members = cast(
                    "list[bytes]",
                    store.client.zrangebylex(key, low, high, start=offset, num=_PAGE),
                )
            found += [member.partition(b"\n")[2].decode() for member in members]
            offset += len(members)
            if len(members) < _PAGE:
                break
    return found


def tag_count(store: Store, tag: str) -> int:
    """Return how many entries are tagged *tag* (parked or in flight), on every shard.

    One ``ZLEXCOUNT`` per shard, whatever the number of entries: cheap enough
    for every view of a page. It counts the index as it is (with
    ``zdelay_signing_key``, the steering calls still check each entry).
    """
    low, high = b"[" + tag.encode() + b"\n", b"(" + tag.encode() + b"\x0b"
    with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
        for shard in store.shards:
            pipe.zlexcount(store.keys(shard).tagged, low, high)
        return sum(int(n) for n in pipe.execute())


def mark_records(store: Store, shard: int, members: list[bytes]) -> list[bytes | None]:
    """The key and tag records of parked *members*; one read, none without marks."""
    if not members:
        return []
    fields = [b"i:" + member for member in members]
    return cast("list[bytes | None]", store.client.hmget(store.keys(shard).marks, fields))


def marks_of(store: Store, task_id: str, shard: int, *, dead: bool = False) -> EntryMarks | None:
    """Return the key and tags recorded for *task_id* on *shard*, or None."""
    field_name = ("d:" if dead else "i:") + task_id
    with store_errors(store.url):
        record = store.client.hget(store.keys(shard).marks, field_name)
    if record is None:
        return None
    return parse_record(_text(record))


def parse_record(record: str) -> EntryMarks:
    """Return the key and tags a record of ``lua/_marks.lua`` holds."""
    head, _, rest = record.partition("\n")
    key, _, tags = rest.partition("\n")
    mode = head[:1]
    return EntryMarks(
        key=key or None,
        on_key=_MODES.get(mode) if key else None,
        tags=tuple(tag for tag in tags.split("\n") if tag),
    )


def key_owner(store: Store, key: str) -> tuple[str, int | None] | None:
    """Return (id, hold end ms or None while parked) of the entry holding *key*, if any."""
    keys = store.keys(store.shard_of(key))
    with store_errors(store.url):
        value = store.client.hget(keys.marks, "k:" + key)
    if value is None:
        return None
    owner, _, until = _text(value).partition("\n")
    return owner, (int(until) if until else None)


# -- check and repair -----------------------------------------------------------


def check_marks(
    store: Store, *, shards: Iterable[int] | None = None, sample: int | None = None
) -> list[MarkProblem]:
    """Return every disagreement between the key and tag index and the entries.

    The scripts keep them in step, so this finds only what something else
    did to the keys (a hand edit, an eviction, a restore of an older dump).

    With *sample*, a shard whose index holds more than *sample* records and
    tag members is checked on a random sample: half of *sample* records and
    a window of half as many tag members at a random rank (and the records
    they name), each judged as the whole check judges it. Its cost then stays
    bounded however many entries carry a key or tags, where the whole check
    reads every record and asks two commands per entry: ``zdelay status
    --check`` passes :data:`CHECK_SAMPLE`. Without it (``zdelay repair``),
    the whole index is read.
    """
    problems: list[MarkProblem] = []
    for shard in store.shards if shards is None else shards:
        problems += _check_shard(store, shard, sample=sample)
    return problems


def _read_index(
    store: Store, shard: int, sample: int | None
) -> tuple[dict[str, str], list[str], bool]:
    """Return the shard's index records, its tag members, and whether that is all of them.

    Above *sample* records and members, a random half-sample of records
    (``HRANDFIELD``) and a window of members at a random rank: O(sample).
    """
    keys = store.keys(shard)
    with store_errors(store.url):
        if sample is not None:
            with store.client.pipeline(transaction=False) as pipe:
                pipe.hlen(keys.marks)
                pipe.zcard(keys.tagged)
                records_n, members_n = (int(n) for n in pipe.execute())
            if records_n + members_n > sample:
                half = max(sample // 2, 1)
                offset = secrets.randbelow(max(members_n - half, 0) + 1)
                with store.client.pipeline(transaction=False) as pipe:
                    pipe.hrandfield(keys.marks, half, withvalues=True)
                    pipe.zrange(keys.tagged, offset, offset + half - 1)
                    pairs, window = pipe.execute()
                # A flat [field, value, ...] list (RESP2), or pairs (RESP3 unparsed).
                flat = [x for pair in pairs or [] for x in pair] if _nested(pairs) else pairs or []
                fields = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
                return fields, [_text(m) for m in window], False
        fields = {
            _text(name): _text(value)
            for name, value in store.client.hscan_iter(keys.marks, count=_PAGE)
        }
        members = [_text(m) for m in store.client.zrange(keys.tagged, 0, -1)]
    return fields, members, True


def _nested(reply: Any) -> bool:
    return bool(reply) and isinstance(reply[0], (list, tuple))


def _check_shard(store: Store, shard: int, *, sample: int | None = None) -> list[MarkProblem]:
    keys = store.keys(shard)
    fields, members, whole = _read_index(store, shard, sample)
    if not whole:
        # Judge each sampled owner and tag member as the whole check would:
        # with the record of the entry it names.
        named = {v.partition("\n")[0] for n, v in fields.items() if n.startswith("k:")}
        named |= {m.partition("\n")[2] for m in members}
        missing = sorted(i for i in named if "i:" + i not in fields)
        if missing:
            with store_errors(store.url):
                found = store.client.hmget(keys.marks, ["i:" + i for i in missing])
            fields.update(
                {"i:" + i: _text(v) for i, v in zip(missing, found, strict=True) if v is not None}
            )
    records = {name[2:]: value for name, value in fields.items() if name.startswith("i:")}
    dead_records = {name[2:]: value for name, value in fields.items() if name.startswith("d:")}
    owners = {name[2:]: value for name, value in fields.items() if name.startswith("k:")}
    ids = sorted({*records, *dead_records, *(v.partition("\n")[0] for v in owners.values())})
    ids += sorted({m.partition("\n")[2] for m in members} - set(ids))
    live, dead = _states(store, shard, ids)
    problems: list[MarkProblem] = []

    def problem(kind: str, detail: str, *fixes: tuple[str, str]) -> None:
        problems.append(MarkProblem(shard, kind, detail, fixes))

    expected_tags: set[str] = set()
    for task_id, record in records.items():
        marks = parse_record(record)
        if task_id not in live:
            problem(
                "stale record",
                f"entry {task_id} has a key/tag record but is not parked",
                ("hdel", "i:" + task_id),
            )
            continue
        expected_tags |= {f"{tag}\n{task_id}" for tag in marks.tags}
    for task_id in dead_records:
        if task_id not in dead:
            problem(
                "stale dead record",
                f"entry {task_id} has a dead-letter record but is not dead",
                ("hdel", "d:" + task_id),
            )
    for key, value in owners.items():
        owner, _, until = value.partition("\n")
        if until:
            continue  # released and running: taken until the worker or max_run_ms frees it
        held_by = records.get(owner)
        if owner not in live:
            problem(
                "stale key",
                f"key {key!r} points at {owner}, which is not parked",
                ("hdel", "k:" + key),
            )
        elif held_by is None or parse_record(held_by).key != key:
            problem(
                "stale key",
                f"key {key!r} points at {owner}, parked without that key",
                ("hdel", "k:" + key),
            )
    for member in set(members) - expected_tags:
        tag, _, task_id = member.partition("\n")
        problem(
            "stale tag",
            f"tag {tag!r} points at {task_id}, which is not parked with it",
            ("zrem", member),
        )
    absent = expected_tags - set(members)
    if not whole:
        # Only a window of the members was read: ask for the others.
        ordered = sorted(absent)
        with store_errors(store.url):
            scores = store.client.zmscore(keys.tagged, ordered) if ordered else []
        absent = {m for m, score in zip(ordered, scores, strict=True) if score is None}
    for member in sorted(absent):
        tag, _, task_id = member.partition("\n")
        problem(
            "missing tag", f"parked entry {task_id} is missing from tag {tag!r}", ("zadd", member)
        )
    return problems


def _states(store: Store, shard: int, ids: list[str]) -> tuple[set[str], set[str]]:
    """Return which of *ids* are parked or in flight, and which are dead-lettered."""
    keys = store.keys(shard)
    live: set[str] = set()
    dead: set[str] = set()
    for start in range(0, len(ids), _PAGE):
        chunk = ids[start : start + _PAGE]
        with store_errors(store.url), store.client.pipeline(transaction=False) as pipe:
            for task_id in chunk:
                pipe.hexists(keys.msg, task_id)
                pipe.zscore(keys.dead, task_id)
            replies = pipe.execute()
        for n, task_id in enumerate(chunk):
            if replies[2 * n]:
                live.add(task_id)
            if replies[2 * n + 1] is not None:
                dead.add(task_id)
    return live, dead


def repair_marks(store: Store, *, shards: Iterable[int] | None = None) -> int:
    """Remove what :func:`check_marks` finds stale and add missing tags; return how many fixes.

    Each fix is checked again inside Redis (WATCH on the shard's keys), so a
    repair racing producers and companions never removes a mark that just
    became right.
    """
    fixed = 0
    for shard in store.shards if shards is None else shards:
        for _ in range(10):
            try:
                fixed += _repair_shard(store, shard)
                break
            except _Changed:
                continue
    return fixed


class _Changed(Exception):
    pass


def _repair_shard(store: Store, shard: int) -> int:
    keys = store.keys(shard)
    with store_errors(store.url), store.client.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(keys.marks, keys.tagged, keys.due, keys.msg, keys.dead)
            problems = _check_shard(store, shard)
            if not problems:
                pipe.reset()
                return 0
            pipe.multi()
            for item in problems:
                for action, name in item.fixes:
                    if action == "hdel":
                        pipe.hdel(keys.marks, name)
                    elif action == "zrem":
                        pipe.zrem(keys.tagged, name)
                    else:
                        pipe.zadd(keys.tagged, {name: 0})
            pipe.execute()
        except WatchError as exc:
            raise _Changed() from exc
    return len(problems)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def signed_with_tag(store: Store, shard: int, task_id: str, payload: Any, tag: str) -> bool:
    """Whether the entry's message is signed with a current key and carries *tag*."""
    try:
        message = decode_entry(
            payload, store.config.signing_keys, store.templates(shard), entry_id=task_id
        )
    except EntryError:
        return False
    tags = message.headers.get(TAGS_HEADER)
    return isinstance(tags, list) and tag in tags
