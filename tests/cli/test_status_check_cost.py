"""``zdelay status --check`` costs the same however many entries carry a key or tags.

Issue 34: the probe read the whole key and tag index (every record, every tag
member, two commands per entry), 1.8 s at 10,000 marked entries and growing
with them. Above :data:`~celery_zdelay.store.marks.CHECK_SAMPLE` index
entries it checks a random sample; ``zdelay repair`` still reads them all.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_zdelay.parking import store_for
from celery_zdelay.store.marks import CHECK_SAMPLE, check_marks
from tests.support.cli import run

pytestmark = pytest.mark.timeout(60)

#: Entries parked with a key and two tags: three index entries each (a record,
#: a key owner, two tag members: 4 counting both tags).
MARKED = 3 * CHECK_SAMPLE


def _park_marked(app: Celery, n: int) -> None:
    task = app.tasks["tests.record"]
    for start in range(0, n, 1000):
        count = min(1000, n - start)
        task.apply_delayed_many(
            [(i,) for i in range(start, start + count)],
            countdown=86_400,
            keys=[f"order:{i}" for i in range(start, start + count)],
            tags=["tenant:1", "batch:7"],
        )


def _commands(app: Celery, *args: str) -> tuple[int, str]:
    """Run ``zdelay <args>``; return the Redis commands it ran and its output."""
    client = store_for(app).client
    client.config_resetstat()
    result = run(app, *args)
    stats = client.info("commandstats")
    calls = sum(
        int(entry["calls"])
        for name, entry in stats.items()
        if name not in ("cmdstat_info", "cmdstat_config|resetstat")
    )
    return calls, result.stdout


def test_status_check_reads_a_bounded_sample_of_a_large_key_and_tag_index(app: Celery) -> None:
    # Given 3,000 parked entries with a key and two tags each: an index of
    # 12,000 records, owners and tag members, well above the sample
    _park_marked(app, MARKED)

    # When status --check probes the store (and status alone, for comparison)
    plain, _ = _commands(app, "status")
    commands, out = _commands(app, "status", "--check")

    # Then the check added a number of Redis commands bounded by the sample,
    # not by the entries (the whole check asked two per entry: over 6,000
    # here), and the consistent index is reported as such: no sampled entry
    # is misjudged
    assert commands - plain <= 2 * CHECK_SAMPLE + 20, (commands, plain)
    assert "key/tag index" not in out, out
    # And the whole check (repair's) still finds the same index consistent
    assert check_marks(store_for(app)) == []


def test_a_sampled_check_finds_a_drift_among_the_entries_it_reads(app: Celery) -> None:
    # Given a large consistent index, and then every tag member of one tag
    # removed by hand (the drift an old dump restored or a hand edit leaves)
    _park_marked(app, MARKED)
    store = store_for(app)
    tagged = store.keys(0).tagged
    store.client.zremrangebylex(tagged, "[batch:7\n", "[batch:7\n\xff")

    # When the check reads a sample of the index
    problems = check_marks(store, sample=CHECK_SAMPLE)

    # Then every sampled entry's missing tag is reported, and nothing else
    assert problems, "a sample of the records misses none of 3,000 missing tags"
    assert {p.kind for p in problems} == {"missing tag"}
    assert all("'batch:7'" in p.detail for p in problems)
    assert len(problems) <= CHECK_SAMPLE


def test_a_sampled_check_judges_the_key_owners_it_draws(app: Celery) -> None:
    # Given a large index whose every key points at an entry that is not parked
    _park_marked(app, MARKED)
    store = store_for(app)
    marks = store.keys(0).marks
    store.client.hset(marks, mapping={f"k:order:{i}": "gone" for i in range(MARKED)})

    # When the check reads a sample (owners are read only from the records drawn)
    problems = check_marks(store, sample=CHECK_SAMPLE)

    # Then the owners drawn are reported stale, and only they: at most half the sample
    stale = [p for p in problems if p.kind == "stale key"]
    assert stale, problems[:3]
    assert all("points at gone" in p.detail for p in stale)
    assert {p.kind for p in problems} == {"stale key"}
    assert len(stale) <= CHECK_SAMPLE // 2
