"""EntryEncoder: what one park of many messages stores is what encode_entry stores, per message."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_zdelay.capture import capture
from celery_zdelay.entry import TaskMessage, encode_entry
from celery_zdelay.entry_many import EntryEncoder

pytestmark = pytest.mark.timeout(60)

#: Options Celery turns into different headers, properties and routing.
OPTIONS: list[dict[str, Any]] = [
    {},
    {"queue": "orders"},
    {"priority": 5},
    {"headers": {"x_custom": "v", "trace": [1, 2]}},
    {"serializer": "msgpack"},
    {"compression": "gzip"},
    {"shadow": "shown-as", "ignore_result": True},
    {"time_limit": 30, "soft_time_limit": 20},
    {"expires": 3600},
    {"eta": "2100-01-01T00:00:00+00:00"},
]


#: One app for the module: a task name is registered once per process.
APP = Celery("entry-many", broker="memory://", set_as_current=False)


@APP.task(name="tests.entry_many.add")
def add(*args: Any, **kwargs: Any) -> None:  # pragma: no cover - never run
    return None


def _messages() -> list[TaskMessage]:
    def send_all(producer: Any) -> None:
        for number, options in enumerate(OPTIONS):
            for args in [(1, 2), (number, "x" * number), ("same", "same")]:
                add.apply_async(args, producer=producer, **options)
            # A call whose per-call values coincide (argsrepr == kwargsrepr
            # text, task id == parent id) has other variable numbers.
            add.apply_async((), {}, producer=producer, task_id="()", **options)

    _, messages = capture(APP, send_all)
    assert len(messages) == 4 * len(OPTIONS)
    return messages


@pytest.mark.parametrize("signing_key", [None, b"k" * 32], ids=["unsigned", "signed"])
@pytest.mark.parametrize("dest", [None, "celery"], ids=["generic", "handoff"])
def test_each_entry_equals_encode_entry(signing_key: bytes | None, dest: str | None) -> None:
    messages = _messages()
    layout = "layout-1" if dest else None
    encoder = EntryEncoder(signing_key)
    # Twice over: the second time every group's template is known.
    for message in messages + messages:
        assert encoder.encode(message, dest=dest, layout=layout) == encode_entry(
            message, dest=dest, layout=layout, signing_key=signing_key
        )


def test_messages_of_one_shape_share_one_template() -> None:
    messages = [m for m in _messages() if m.headers["argsrepr"] in ("(1, 2)", "(0, '')")]
    encoder = EntryEncoder()
    templates = {encoder.encode(m)[1] for m in messages[:2]}
    assert len(templates) == 1


def test_an_encoder_that_remembers_few_groups_starts_again_and_stays_exact() -> None:
    # Given an encoder kept across parks that remembers two groups at most
    messages = _messages()
    encoder = EntryEncoder(max_groups=2)

    # When it encodes messages of many shapes, twice over
    for message in messages + messages:
        # Then each entry is still encode_entry's, and it never holds more
        assert encoder.encode(message, dest="celery", layout="l") == encode_entry(
            message, dest="celery", layout="l"
        )
        assert len(encoder._templates) <= 2


def test_the_producer_keeps_one_encoder_per_configuration(app: Celery) -> None:
    from celery_zdelay.app_state import producing as _parking

    # Given an app that parked a call
    record = app.tasks["tests.record"]
    record.apply_delayed((1,), countdown=600)
    encoder = _parking(app).encoder
    groups = len(encoder._templates)

    # When it parks the same call again, then another configuration's
    record.apply_delayed((2,), countdown=600)
    assert _parking(app).encoder is encoder
    assert len(encoder._templates) == groups  # the same group: known already
    app.conf.zdelay_signing_key = "k" * 32
    record.apply_delayed((3,), countdown=600)

    # Then the new configuration has an encoder of its own
    assert _parking(app).encoder is not encoder
