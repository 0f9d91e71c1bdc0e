"""What a consuming service's /metrics says of its consumer group, on a real Redis: entries handled and
failed, handler latency, dead letters, and the group's lag and pending entries as Redis has them at the
scrape."""

from __future__ import annotations

import uuid

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rollstream.shared.contract.bus import run_consumer
from rollstream.shared.contract.consumers import ConsumerGroup
from tests.support import prompt


def scraped(**labels: str) -> dict[str, float]:
    """The process's exposition as /metrics serves it: series name -> value, for samples with these labels."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if all(sample.labels.get(key) == value for key, value in labels.items()):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def test_a_groups_handled_failed_and_waiting_entries_show_on_its_metrics(bus):
    group = ConsumerGroup(f"metrics-{uuid.uuid4().hex[:8]}", ("prompts",))
    for index in range(4):
        bus.publish("prompts", prompt(index), rollout_id=f"r{index}")
    rounds = []

    def handle(delivery) -> None:
        if delivery.event.sample_index == 1:
            raise ValueError("this one fails")

    run_consumer(bus, group, "c1", handle, should_stop=lambda: bool(rounds),
                 between_reads=lambda: rounds.append(1))
    for index in range(4, 6):  # published after the group's read: waiting for it
        bus.publish("prompts", prompt(index), rollout_id=f"r{index}")

    ours = scraped(stream="prompts", group=group.name)
    handled = "rollstream_bus_events_handled_total"
    assert scraped(stream="prompts", group=group.name, outcome="ok")[handled] == 3
    assert scraped(stream="prompts", group=group.name, outcome="failed")[handled] == 1
    assert ours["rollstream_bus_handler_seconds_count"] == 4
    assert ours["rollstream_bus_consumer_lag"] == 2
    assert ours["rollstream_bus_pending_entries"] == 1
    assert scraped(stream="prompts")["rollstream_bus_stream_length"] >= 6


def test_an_entry_that_does_not_decode_counts_as_a_dead_letter_of_its_group(bus):
    group = f"metrics-{uuid.uuid4().hex[:8]}"
    bus.ensure_group("prompts", group)
    bus.redis.xadd(bus.keys.stream("prompts"), {"type": "PromptIssued", "v": "1", "body": b"\x00garbage"})
    assert bus.consume("prompts", group, "c1", block_ms=10) == []
    assert scraped(stream="prompts", group=group)["rollstream_bus_dead_letters_total"] == 1
    assert bus.redis.xlen(bus.keys.stream("dead")) == 1
