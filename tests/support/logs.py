"""Counting what the code under test logged."""

from __future__ import annotations

import logging

import pytest

__all__ = ["error_lines"]


def error_lines(caplog: pytest.LogCaptureFixture, text: str) -> int:
    """How many records at ERROR or above carry *text* in their message."""
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
