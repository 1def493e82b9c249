"""The Django project of ``tests/contrib/django/test_django.py``: settings only, real SQLite."""
