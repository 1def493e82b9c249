"""The periodic part's bounded caches (:class:`celery_zdelay.periodic.recent.Recent`)."""

from __future__ import annotations

import threading

import pytest

from celery_zdelay.periodic.recent import Recent

pytestmark = pytest.mark.timeout(30)


def test_the_entry_used_longest_ago_goes_first() -> None:
    kept: Recent[str, int] = Recent(2)
    kept.put("a", 1)
    kept.put("b", 2)
    assert kept.get("a") == 1  # a is now the one used last
    kept.put("c", 3)

    # b, used longest ago, went (mutant: the first put dropped, as a FIFO)
    assert kept.get("b") is None
    assert (kept.get("a"), kept.get("c")) == (1, 3)
    assert len(kept) == 2


def test_keep_answers_the_object_kept_for_an_equal_key() -> None:
    kept: Recent[str, list[int]] = Recent(10)
    first = kept.keep("k", [1])
    second = kept.keep("k", [1])

    # One object for equal keys (mutant: the new value kept instead)
    assert second is first
    assert kept.keep("other", [2]) == [2]


def test_pop_forgets_and_a_size_below_one_is_refused() -> None:
    kept: Recent[str, int] = Recent(1)
    kept.put("a", 1)
    kept.pop("a")
    kept.pop("never kept")
    assert kept.get("a") is None
    with pytest.raises(ValueError, match="at least one"):
        Recent(0)


def test_threads_keeping_at_once_stay_within_the_bound() -> None:
    # The rows' reader and the pass share the spec cache: every thread gets
    # a value and the cache never grows past its size (mutant: no lock,
    # then an eviction races another's and raises KeyError or overshoots)
    kept: Recent[int, int] = Recent(50)
    errors: list[BaseException] = []

    def churn(offset: int) -> None:
        try:
            for i in range(20_000):
                assert kept.keep((i * 7 + offset) % 400, i) is not None
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=25)
    assert not errors
    assert len(kept) <= 50
