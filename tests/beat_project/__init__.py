"""A Django project with django-celery-beat, for the database schedule source tests.

Its database comes from ``ZDELAY_TEST_BEAT_DB``: ``sqlite:<path>`` or
``postgres:<database>`` (the machine's PostgreSQL on 127.0.0.1, trust auth).
"""
