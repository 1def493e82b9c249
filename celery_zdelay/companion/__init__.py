"""The companion process: releases parked entries to the broker when due."""

from __future__ import annotations

from .loop import Companion, PassReport

__all__ = ["Companion", "PassReport"]
