"""Reclaim: what a dead consumer left pending, taken over by a live one of its group (XAUTOCLAIM).

A consumer acknowledges each entry once it has handled it; an entry it was handling when it died stays pending
in its group, on its name, and so does an entry whose handler failed. Bus.consume first takes over entries
pending longer than bus.reclaim_idle_ms, and counts how often the group was handed each (dead_letters.py
gives one up after bus.max_deliveries). A consumer still working on an entry after that long keeps it with
keep_alive; a consumer alone in its group (the trainer) takes over every pending entry, in order, when it
starts, without waiting for the reclaim timeout.

    python -m pytest tests/unit/shared/contract/test_reclaim.py -q
"""

from __future__ import annotations

import time
from collections.abc import Collection

import redis

from rollstream.shared.runtime.sections.bus import BusSettings

TAKE_OVER_PAGE = 1000
"""Entries one XAUTOCLAIM takes over when a lone consumer takes over every pending entry."""


class Reclaim:
    """One bus's reclaim: entries taken over on its Redis, and when to look again, per stream and group, after
    a look that found none."""

    def __init__(self, client: redis.Redis, settings: BusSettings) -> None:
        self.redis = client
        self.settings = settings
        self._next_look: dict[tuple[str, str], float] = {}  # per stream key and group: see idle_entries

    def idle_entries(self, key: str, group: str, consumer: str, count: int) -> list:
        """Entries pending over reclaim_idle_ms, now this consumer's (XAUTOCLAIM). A look that finds none is
        repeated a tenth of reclaim_idle_ms later, not at the next read: a busy consumer does not pay a round
        trip per read for it, and an entry waits at most 1.1 times reclaim_idle_ms."""
        now = time.monotonic()
        if now < self._next_look.get((key, group), 0.0):
            return []
        idle_ms = self.settings.reclaim_idle_ms
        reclaimed = self.redis.xautoclaim(key, group, consumer, idle_ms, "0-0", count=count)[1]
        if not reclaimed:
            self._next_look[(key, group)] = now + idle_ms / 10_000
        return reclaimed

    def without_held(self, key: str, group: str, consumer: str, raw: list, held: Collection[str]) -> list:
        """The reclaimed entries but those the consumer holds, whose delivery count is set back (XCLAIM
        RETRYCOUNT; JUSTID counts no delivery)."""
        mine = [entry for entry in raw if entry[0].decode() in held]
        if not mine:
            return raw
        for entry_id, deliveries in self.delivery_counts(key, group, mine).items():
            self.redis.xclaim(key, group, consumer, 0, [entry_id], retrycount=max(deliveries - 1, 1),
                              justid=True)
        return [entry for entry in raw if entry[0].decode() not in held]

    def delivery_counts(self, key: str, group: str, raw: list) -> dict[str, int]:
        """How many times the group was handed each of the entries `raw`, by entry id."""
        ids = [entry_id for entry_id, _ in raw]
        pending = self.redis.xpending_range(key, group, min=ids[0], max=ids[-1], count=len(ids) * 4 + 16)
        wanted = {i.decode() for i in ids}
        out = {}
        for row in pending:
            entry_id = row["message_id"]
            entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if entry_id in wanted:
                out[entry_id] = row["times_delivered"]
        return out

    def keep_alive(self, key: str, group: str, consumer: str, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this consumer is still working on, so that live consumers
        do not reclaim a long episode from a replica that is alive (XCLAIM JUSTID: no delivery counted)."""
        if entry_ids:
            self.redis.xclaim(key, group, consumer, 0, entry_ids, justid=True)

    def every_pending_entry(self, key: str, group: str, consumer: str) -> list:
        """Claim every entry pending in the group for `consumer` and return them, oldest first, as XREADGROUP
        does (an entry trimmed away while pending comes back without fields)."""
        start = "0-0"
        while True:
            start, *_ = self.redis.xautoclaim(key, group, consumer, 0, start, count=TAKE_OVER_PAGE)
            if start in (b"0-0", "0-0"):
                break
        return (self.redis.xreadgroup(group, consumer, {key: "0"}) or [[None, []]])[0][1]
