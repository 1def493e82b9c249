"""The Django project of ``tests/test_django.py``: settings only, real SQLite."""
