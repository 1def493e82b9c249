"""Shard ownership leases: companions split the shards instead of contending.

Without them every companion claims from every shard: claims are atomic, so
nothing is released twice, but companions woken by the same due time race
for the same entries and most of their calls come back empty. With
``zdelay_shard_leases`` each companion owns its fair share of the shards (an
expiring ``{prefix:N}:owner`` key per shard) and claims only from those.

- Fair share: the shard count divided by the live companions (heartbeats).
- A companion renews its leases every third of a lease, gives up shards above
  its share (so a new companion gets some) and takes unowned shards up to its
  share.
- A shard that stays unowned for two looks in a row is taken by whoever sees
  it, share or not: a companion that dies hands its shards over within one
  ``zdelay_lease_seconds``.
- A shard taken that way is kept above the share while as many companions
  are live as when it was taken. A companion that died still counts as live
  until its heartbeat ages out (30 s), so the share stays as it was; giving
  the orphan up at the next look would hand it to nobody, and its entries
  would wait a check interval, again at every other look, until then. Once
  the count changes (the dead one forgotten, or a companion joined), the
  share rules again and the surplus goes to whoever is below its share.
- That keeping ends after :data:`ORPHAN_KEEP_SECONDS` all the same: by then
  a dead owner no longer counts as live, so a count that has not changed
  means a live companion is below its share (one that started slowly, whose
  shards were taken before its first look) and the surplus goes to it.
- A shard this companion gave up for another is not taken back as an orphan
  for one owner lease: the companion it was given up for looks three times
  in that time. (Taken back at the second look, as before, a slow companion
  on a loaded machine never got its share: the orphan was kept for good.)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

from ..store import Store
from ..store.heartbeats import COMPANION_ALIVE_MS

__all__ = ["ShardOwnership"]

logger = logging.getLogger(__name__)

#: Shortest shard lease, in ms.
MIN_OWNER_LEASE_MS = 1000
#: How long a shard taken as an orphan stays above the share at most: until a
#: dead owner's heartbeat has aged out of the live count (COMPANION_ALIVE_MS),
#: plus the 5 s until this companion's next heartbeat reads the new count,
#: with a margin.
ORPHAN_KEEP_SECONDS = COMPANION_ALIVE_MS / 1000 + 10


class ShardOwnership:
    """The shards one companion owns, kept up to date by :meth:`maybe_renew`."""

    def __init__(
        self, store: Store, companion_id: str, shards: Sequence[int], *, lease_ms: int
    ) -> None:
        self.store = store
        self.companion_id = companion_id
        self.candidates = list(shards)
        # Half a lease, checked every sixth: an owner that died is replaced
        # (after two looks at its unowned shards) well within one lease.
        self.owner_lease_ms = max(MIN_OWNER_LEASE_MS, lease_ms // 2)
        self.check_seconds = self.owner_lease_ms / 3000
        self.owned: set[int] = set()
        self._seen_unowned: set[int] = set()
        #: Shards taken as orphans: the live companions counted then, and when.
        self._orphans: dict[int, tuple[int, float]] = {}
        #: Shards this companion gave up (above its share), and when.
        self._given_up: dict[int, float] = {}
        self._next_check = 0.0
        #: The monotonic clock (a test moves it).
        self.clock = time.monotonic

    def shards(self) -> list[int]:
        """Return the shards this companion releases now."""
        return sorted(self.owned)

    def maybe_renew(self, live_companions: int) -> None:
        """Renew, give up and take shard leases, at most every check interval."""
        now = self.clock()
        if now < self._next_check:
            return
        self._next_check = now + self.check_seconds
        share = math.ceil(len(self.candidates) / max(live_companions, 1))
        before = set(self.owned)
        for shard in sorted(self.owned):
            if not self._own(shard, "renew"):
                self.owned.discard(shard)
        # Orphans stay, outside the share, while the live count is the one
        # that still counts their dead owner: no one else would take them.
        shared = [
            s for s in sorted(self.owned, reverse=True) if not self._kept(s, live_companions, now)
        ]
        for shard in shared[: max(0, len(shared) - share)]:
            self._own(shard, "release")
            self.owned.discard(shard)
            self._given_up[shard] = now
        self._orphans = {
            s: taken
            for s, taken in self._orphans.items()
            if s in self.owned and self._kept(s, live_companions, now)
        }
        grace = self.owner_lease_ms / 1000
        self._given_up = {s: at for s, at in self._given_up.items() if now - at < grace}
        unowned = set()
        for shard in self.candidates:
            if shard in self.owned or self.store.owner(shard) is not None:
                continue
            unowned.add(shard)
            orphaned = shard in self._seen_unowned and shard not in self._given_up
            if (len(self.owned) < share or orphaned) and self._own(shard, "acquire"):
                if len(self.owned) >= share:
                    self._orphans[shard] = (live_companions, now)
                self.owned.add(shard)
        self._seen_unowned = unowned - self.owned
        if self.owned != before:
            logger.info(
                "Companion %s now owns shards %s (share %d of %d, %d live companions)",
                self.companion_id,
                ",".join(map(str, sorted(self.owned))) or "none",
                share,
                len(self.candidates),
                live_companions,
            )

    def _kept(self, shard: int, live_companions: int, now: float) -> bool:
        """Whether *shard*, taken as an orphan, stays above the share."""
        taken = self._orphans.get(shard)
        if taken is None:
            return False
        taken_with, taken_at = taken
        return live_companions == taken_with and now - taken_at < ORPHAN_KEEP_SECONDS

    def release_all(self) -> None:
        """Give up every lease, so others take the shards at once."""
        for shard in sorted(self.owned):
            try:
                self._own(shard, "release")
            except Exception:  # the store is down: the leases expire on their own
                logger.debug("Could not release shard %d", shard, exc_info=True)
        self.owned.clear()
        self._orphans.clear()
        self._given_up.clear()

    def _own(self, shard: int, action: str) -> bool:
        return self.store.own(shard, self.companion_id, action, lease_ms=self.owner_lease_ms)
