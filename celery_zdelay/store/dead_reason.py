"""Why an entry was dead-lettered: the record stored beside its payload."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["DeadReason"]


@dataclass(frozen=True)
class DeadReason:
    """The reason record of a dead-lettered entry, as JSON in the dead-letter hash.

    Written by the companion (or by handoff.lua, in the same shape) and read
    back by ``zdelay dead list`` (:mod:`.deadletters`).
    """

    #: What went wrong and what to do about it, for people.
    reason: str
    #: When the entry was due (Redis clock, ms).
    due_ms: int
    #: The companion that dead-lettered it.
    companion: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: bytes | str) -> DeadReason:
        """Read a record that handoff.lua wrote."""
        record = json.loads(raw)
        return cls(
            reason=str(record["reason"]),
            due_ms=int(record["due_ms"]),
            companion=str(record["companion"]),
        )
