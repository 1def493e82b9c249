"""What many tests repeat, in one place: key names, the Redis clock, dead letters, wake-ups.

Test files import from here (and from ``tests.helpers``), never from each
other: a helper that two test files need moves here.
"""
