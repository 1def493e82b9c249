"""One rule for every task id, key, tag and limit key, checked where a value enters.

The store joins ids, keys and tags with newlines in its records (a key's
owner is ``"<id>\\n<until ms>"``): given a task parked under the id
``"a\\nb"`` and the key ``k``, the owner read back was ``"a"``, free since
ms 0, and a later ``on_key="keep"`` call parked a second task. Now every
park path, every by-id operation, the CLI and the dashboard refuse a value
holding a control character (U+0000-U+001F, U+007F-U+009F) or a lone
surrogate with a ``ConfigurationError`` that says what to use, before
anything is written (``celery_zdelay.names``).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlencode

import pytest
import redis
from celery import Celery, group
from werkzeug.test import Client

import celery_zdelay
from celery_zdelay import ConfigurationError
from celery_zdelay.cli import EXIT_USAGE
from celery_zdelay.names import MAX_NAME_LENGTH, validate_limit_key
from celery_zdelay.parking import store_for
from celery_zdelay.periodic.definition import from_beat_entry
from celery_zdelay.steering import purge_dead, requeue_dead
from celery_zdelay.store.marks import check_marks, key_owner
from celery_zdelay.web import create_app
from tests.support.cli import run
from tests.support.keys import keys_of

pytestmark = pytest.mark.timeout(60)

#: Ids (and keys, tags) that would shift a record's fields, or cannot be UTF-8.
BAD = ["a\nb", "a\x00b", "a\tb", "\x7f", "a\x85b", "a\x9fb", "a\ud800b"]
#: What stays allowed: spaces, colons, any printable character.
GOOD = ["order 42", "a:b:c", "été ✓", "tenant/7#x"]
REFUSED = "U\\+[0-9A-F]{4}"


def _all_keys(client: redis.Redis) -> list[bytes]:
    return sorted(client.keys("{zdelay*"))


# -- the defect ------------------------------------------------------------------------------


def test_a_newline_in_a_task_id_is_refused_so_a_key_keeps_one_task(
    app: Celery, redis_client: redis.Redis
) -> None:
    record = app.tasks["tests.record"]
    # Given a caller's own id with a newline, under a key: refused, nothing written
    with pytest.raises(ConfigurationError, match="U\\+000A at position 1") as refused:
        record.apply_delayed(("first",), countdown=600, task_id="a\nb", key="k")
    assert "Use printable characters only" in str(refused.value)
    assert _all_keys(redis_client) == []
    # When the key is then used twice with keep, one task owns it
    first = record.apply_delayed(("second",), countdown=600, key="k", on_key="keep")
    second = record.apply_delayed(("third",), countdown=600, key="k", on_key="keep")
    assert second.id == first.id
    assert redis_client.zcard(keys_of(0).due) == 1
    assert key_owner(store_for(app), "k") == (first.id, None)
    assert check_marks(store_for(app)) == []


# -- every park path ---------------------------------------------------------------------------


def _park_paths(app: Celery) -> dict[str, Any]:
    record = app.tasks["tests.record"]

    def in_batch(task_id: str) -> None:
        with celery_zdelay.batch(app):
            record.apply_delayed((1,), countdown=60)
            record.apply_delayed((2,), countdown=60, task_id=task_id)

    return {
        "apply_delayed": lambda i: record.apply_delayed((1,), countdown=60, task_id=i),
        "keyed": lambda i: record.apply_delayed((1,), countdown=60, task_id=i, key="k"),
        "tagged": lambda i: record.apply_delayed((1,), countdown=60, task_id=i, tags=["t"]),
        "send_delayed": lambda i: celery_zdelay.send_delayed(
            app, "tests.record", (1,), countdown=60, task_id=i
        ),
        "signature": lambda i: celery_zdelay.apply_delayed(
            record.s(1).set(task_id=i), countdown=60, app=app
        ),
        "group": lambda i: celery_zdelay.apply_delayed(
            group(record.s(1), record.s(2).set(task_id=i)), countdown=60, app=app
        ),
        "batch": in_batch,
    }


@pytest.mark.parametrize("bad", BAD, ids=ascii)
def test_every_park_path_refuses_a_bad_task_id_and_parks_nothing(
    app: Celery, redis_client: redis.Redis, bad: str
) -> None:
    for name, park in _park_paths(app).items():
        with pytest.raises(ConfigurationError, match=REFUSED):
            park(bad)
        assert _all_keys(redis_client) == [], name


@pytest.mark.parametrize("good", GOOD, ids=ascii)
def test_printable_ids_keys_and_tags_are_parked_as_before(app: Celery, good: str) -> None:
    record = app.tasks["tests.record"]
    result = record.apply_delayed((1,), countdown=60, task_id=good, key=good, tags=[good])
    found = celery_zdelay.lookup(good, app=app)
    assert result.id == good
    assert found is not None
    assert found.key == good
    assert found.tags == (good,)
    assert record.apply_delayed((2,), countdown=60, key=good).id == good
    assert check_marks(store_for(app)) == []


@pytest.mark.parametrize("bad", ["a\x85b", "a\x9fb", "a\ud800b"], ids=ascii)
def test_keys_and_tags_follow_the_same_rule_c1_controls_and_surrogates_included(
    app: Celery, redis_client: redis.Redis, bad: str
) -> None:
    record = app.tasks["tests.record"]
    for options in ({"key": bad}, {"tags": [bad]}):
        with pytest.raises(ConfigurationError, match=REFUSED):
            record.apply_delayed((1,), countdown=60, **options)
    with pytest.raises(ConfigurationError, match=REFUSED):
        record.apply_delayed_many([(1,)], countdown=60, keys=[bad])
    assert _all_keys(redis_client) == []


def test_a_limit_key_has_its_check_ready_with_the_same_rule() -> None:
    assert validate_limit_key("tenant:42") == "tenant:42"
    for bad in [*BAD, "", "x" * (MAX_NAME_LENGTH + 1), 42]:
        with pytest.raises(ConfigurationError, match="limit_key="):
            validate_limit_key(bad)


def test_a_schedule_name_with_a_control_character_is_refused_where_it_is_defined() -> None:
    # Its occurrences' task ids hold the name: refused at definition, not at every tick.
    with pytest.raises(ConfigurationError, match="control characters"):
        from_beat_entry("nightly\x01", {"task": "tests.record", "schedule": 60.0})


# -- by id ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD, ids=ascii)
def test_cancel_reschedule_lookup_requeue_and_purge_refuse_a_bad_id_and_change_nothing(
    app: Celery, redis_client: redis.Redis, bad: str
) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600, tags=["t"])
    before = sorted(redis_client.zrange(keys_of(0).due, 0, -1, withscores=True))
    calls = [
        lambda: celery_zdelay.cancel(bad, app=app),
        lambda: celery_zdelay.steering.cancel_ids([parked.id, bad], app=app),
        lambda: celery_zdelay.reschedule(bad, countdown=5, app=app),
        lambda: celery_zdelay.steering.reschedule_ids(
            [parked.id, bad], celery_zdelay.schedule.Due("r", 5), app=app
        ),
        lambda: celery_zdelay.lookup(bad, app=app),
        lambda: requeue_dead([bad], app=app),
        lambda: purge_dead([bad], app=app),
    ]
    for call in calls:
        with pytest.raises(ConfigurationError, match=REFUSED):
            call()
    assert sorted(redis_client.zrange(keys_of(0).due, 0, -1, withscores=True)) == before


# -- the CLI and the dashboard ---------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["cancel", "{}"],
        ["reschedule", "{}", "--countdown", "5"],
        ["dead", "requeue", "{}"],
        ["dead", "purge", "--yes", "{}"],
    ],
)
def test_the_cli_refuses_a_bad_id_with_exit_2(
    app: Celery, redis_client: redis.Redis, command: list[str]
) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    before = _all_keys(redis_client)

    result = run(app, *[f"{parked.id}\n" if arg == "{}" else arg for arg in command])

    assert result.exit_code == EXIT_USAGE, result.output
    assert "U+000A" in result.stderr
    assert _all_keys(redis_client) == before
    assert celery_zdelay.lookup(parked.id, app=app) is not None


def _dashboard(app: Celery) -> tuple[Client, str]:
    client = Client(create_app(app, actions=True))
    html = client.get("/parked").get_data(as_text=True)
    match = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert match
    return client, match.group(1)


@pytest.mark.parametrize(
    ("path", "op"),
    [("/actions/parked", "cancel"), ("/actions/parked", "run"), ("/actions/dead", "purge")],
)
def test_the_dashboard_refuses_a_bad_id_in_an_action_with_a_400(
    app: Celery, redis_client: redis.Redis, path: str, op: str
) -> None:
    parked = app.tasks["tests.record"].apply_delayed((1,), countdown=600)
    client, token = _dashboard(app)
    before = _all_keys(redis_client)

    reply = client.post(
        path, data={"csrf_token": token, "op": op, "ids": [parked.id, parked.id + "\n"]}
    )

    assert reply.status_code == 400
    assert "U+000A" in reply.get_data(as_text=True)
    assert _all_keys(redis_client) == before
    # And the entry page says the same of such an id
    page = client.get("/entry?" + urlencode({"id": "a\nb"}))
    assert page.status_code == 400
    assert "U+000A" in page.get_data(as_text=True)
