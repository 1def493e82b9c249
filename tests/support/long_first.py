"""Under pytest-xdist, the long tests start first, one share at the head of each worker's queue.

xdist's ``worksteal`` hands each worker a contiguous block of the collected
tests and, at the end, idle workers steal from the tail of the others'
queues. A 90 s test that happens to sit late in its block starts when the
others are nearly done, and the run waits for it alone (seen: the whole
suite's last 45 s were one such test). Here the long tests move to the
heads of the blocks, spread over them, longest first, so the run ends on
short ones.

A test is long by what it declares: a ``timeout`` mark of at least
:data:`LONG_TIMEOUT_S` (the default is 120 s; the tests that run for a
minute or more raise theirs). Nobody keeps a list.
"""

from __future__ import annotations

import pytest

#: A test whose timeout mark is at least this long is started first.
LONG_TIMEOUT_S = 300


def timeout_of(item: pytest.Item) -> float:
    mark = item.get_closest_marker("timeout")
    if mark is None or not mark.args or not isinstance(mark.args[0], (int, float)):
        return 0.0
    return float(mark.args[0])


def blocks(count: int, workers: int) -> list[int]:
    """The sizes of the blocks xdist's worksteal first sends each of *workers* (in order)."""
    sizes = []
    left = count
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def long_first(items: list[pytest.Item], workers: int) -> list[pytest.Item]:
    """*items* reordered: each worker's first block starts with its share of the long ones."""
    long = [i for i in items if timeout_of(i) >= LONG_TIMEOUT_S]
    long.sort(key=timeout_of, reverse=True)
    if not long or workers < 2:
        return items
    chosen = {id(i) for i in long}
    rest = [i for i in items if id(i) not in chosen]
    ordered: list[pytest.Item] = []
    for worker, size in enumerate(blocks(len(items), workers)):
        share = long[worker::workers]
        fill = max(0, size - len(share))
        ordered += share + rest[:fill]
        del rest[:fill]
    return ordered + rest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # After deselection (-m, -k): the blocks are cut from what is left. Each
    # xdist worker collects and reorders alike (xdist checks they agree).
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        items[:] = long_first(items, int(workerinput["workercount"]))
