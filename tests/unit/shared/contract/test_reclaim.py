"""Reclaim (reclaim.py) through the bus on a real Redis 7.0, a real Valkey and a real Redis Cluster: what a
dead consumer left pending is taken over by a live one, a live consumer keeps what it works on, and a lone
consumer restarted finishes its predecessor's entries first.

    python -m pytest tests/unit/shared/contract/test_reclaim.py -q
"""

import time

import pytest

from rollstream.shared.contract.bus import Bus, StopConsuming, run_consumer
from rollstream.shared.contract.consumers import ConsumerGroup
from rollstream.shared.runtime.config import BusSettings
from tests.support import prompt

# on a Redis Cluster too: transactions and multi-key commands must hold where a run's keys share one slot
pytestmark = pytest.mark.parametrize("redis_url", ["redis", "valkey", "cluster"], indirect=True)


def test_entry_of_a_dead_consumer_is_reclaimed(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(7))
    first = bus.consume("prompts", "g", "dies")
    assert len(first) == 1  # delivered, never acknowledged: the consumer died
    assert bus.consume("prompts", "g", "alive", block_ms=10) == []  # not idle long enough yet
    time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)
    again = bus.consume("prompts", "g", "alive")
    assert [d.event.sample_index for d in again] == [7]
    bus.ack(again[0], "g")
    assert bus.group_lag("prompts", "g") == (0, 0)


def test_a_consumer_that_keeps_reading_reclaims_a_dead_ones_entry(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(7))
    assert len(bus.consume("prompts", "g", "dies")) == 1
    got, deadline = [], time.monotonic() + bus.settings.reclaim_idle_ms / 1000 * 10
    while not got and time.monotonic() < deadline:
        got = bus.consume("prompts", "g", "alive", block_ms=5)
    assert [d.event.sample_index for d in got] == [7]


def test_a_consumer_looks_for_entries_to_reclaim_now_and_then_not_at_every_read(bus, monkeypatch):
    busy = Bus(bus.redis, bus.keys.run_id, BusSettings(reclaim_idle_ms=60_000))
    busy.ensure_group("prompts", "g")
    looks = []
    look = bus.redis.xautoclaim
    monkeypatch.setattr(bus.redis, "xautoclaim",
                        lambda *args, **kwargs: looks.append(1) or look(*args, **kwargs))
    for index in range(5):
        busy.publish("prompts", prompt(index))
        assert [d.event.sample_index for d in busy.consume("prompts", "g", "c", block_ms=5)] == [index]
    assert len(looks) == 1


def test_a_handler_that_fails_once_succeeds_on_redelivery(bus):
    bus.publish("prompts", prompt(4))
    seen = []

    def handle(delivery):
        seen.append(delivery.event.sample_index)
        if len(seen) == 1:
            raise RuntimeError("transient")

    deadline = time.monotonic() + 10
    run_consumer(bus, ConsumerGroup("g", ("prompts",)), "c", handle,
                 should_stop=lambda: len(seen) >= 2 or time.monotonic() > deadline)
    assert seen == [4, 4]
    assert bus.read_all("dead") == []
    assert bus.group_lag("prompts", "g") == (0, 0)


def test_keep_alive_stops_a_live_consumers_entry_from_being_reclaimed(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(5))
    (working,) = bus.consume("prompts", "g", "busy")
    for _ in range(3):
        time.sleep(bus.settings.reclaim_idle_ms / 1000 * 0.6)
        bus.keep_alive("prompts", "g", "busy", [working.entry_id])
    assert bus.consume("prompts", "g", "other", block_ms=10) == []  # idle time was reset each time
    time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)  # the busy consumer died
    assert [d.entry_id for d in bus.consume("prompts", "g", "other")] == [working.entry_id]


def test_a_late_keep_alive_neither_hands_an_entry_back_to_its_consumer_nor_counts_a_delivery(bus):
    bus.ensure_group("prompts", "g")
    bus.publish("prompts", prompt(5))
    (working,) = bus.consume("prompts", "g", "busy")
    for _ in range(bus.settings.max_deliveries + 1):  # a keep-alive late each time (the event loop was busy)
        time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)
        assert bus.consume("prompts", "g", "busy", block_ms=10, held={working.entry_id}) == []
    (pending,) = bus.redis.xpending_range(bus.keys.stream("prompts"), "g", "-", "+", 10)
    assert pending["times_delivered"] == 1 and pending["consumer"] == b"busy"
    assert bus.read_all("dead") == []
    time.sleep(bus.settings.reclaim_idle_ms / 1000 + 0.1)  # the busy consumer died: another takes it over
    assert [d.entry_id for d in bus.consume("prompts", "g", "other")] == [working.entry_id]


def test_a_restarted_lone_consumer_finishes_its_predecessors_entries_first_in_order(bus):
    for i in range(4):
        bus.publish("prompts", prompt(i))
    handled = []

    def crash_at_1(delivery):
        handled.append(delivery.event.sample_index)
        if delivery.event.sample_index == 1:
            raise StopConsuming("killed mid-entry")

    bus.ensure_group("prompts", "g")
    bus.consume("prompts", "g", "old-process", count=1)  # delivered to a process that then vanished
    with pytest.raises(StopConsuming):
        run_consumer(bus, ConsumerGroup("g", ("prompts",)), "trainer", crash_at_1, should_stop=lambda: False,
                     take_over_pending=True)
    assert handled == [0, 1]

    handled.clear()
    run_consumer(bus, ConsumerGroup("g", ("prompts",)), "trainer",
                 lambda delivery: handled.append(delivery.event.sample_index),
                 should_stop=lambda: len(handled) >= 3, take_over_pending=True)
    # no reclaim timeout waited for, nothing skipped, nothing repeated that was acknowledged
    assert handled == [1, 2, 3]
    assert bus.group_lag("prompts", "g") == (0, 0)
