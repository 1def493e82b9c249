"""What many tests repeat, in one place, one module per concern.

- ``keys``: key names, from the code that names them (no raw ``{zdelay:0}:due``);
- ``clock``: the Redis clock every due decision uses;
- ``store``: a stocked store, entries written by hand, ``is_parked``, ``due_ms``;
- ``deadletters``: dead letters read and written as a companion writes them;
- ``cli``: the ``celery zdelay`` commands run in the test's process;
- ``wake``: the wake-ups a park or a reschedule publishes;
- ``events``, ``logs``: Celery events as Flower receives them; error lines logged;
- ``periodic``: companions serving a schedule, a tending pass, occurrences;
- ``fidelity``: a released message compared with the one Celery sends;
- ``browser``: a headless Chromium and an operator's page (pytest fixtures);
- ``django``: a migrated Django database (a pytest fixture) and an app of Django tasks;
- ``prometheus``, ``trace_view``: a real Prometheus; a trace drawn for the docs.

Test files import from here (and from ``tests.helpers``), never from each
other: a helper that two test files need moves here. Fixtures many files use
(``app``, ``store``, ``stocked``, ``redis_client``, ...) are in
``tests/conftest.py``, which loads ``browser`` and ``django`` as plugins.
"""
