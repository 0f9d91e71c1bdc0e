"""Dead letters (dead_letters.py) through the bus on a real Redis 7.0, a real Valkey and a real Redis Cluster:
an entry that does not decode, does not belong on its stream or fails every delivery goes to `dead` with why,
and the rest is delivered.

    python -m pytest tests/unit/shared/contract/test_dead_letters.py -q
"""

import time

import pytest

from rollstream.shared.contract.bus import run_consumer
from rollstream.shared.contract.consumers import ConsumerGroup
from rollstream.shared.contract.events import DeadLettered
from tests.support import prompt

# on a Redis Cluster too: transactions and multi-key commands must hold where a run's keys share one slot
pytestmark = pytest.mark.parametrize("redis_url", ["redis", "valkey", "cluster"], indirect=True)


def test_malformed_entry_goes_to_dead_letters_and_the_rest_is_delivered(bus):
    bus.ensure_group("prompts", "g")
    bus.redis.xadd(bus.keys.stream("prompts"), {"type": "PromptIssued", "v": "1", "body": b"not msgpack"})
    bus.redis.xadd(bus.keys.stream("prompts"), {"hello": "world"})
    bus.publish("prompts", prompt(1))
    got = bus.consume("prompts", "g", "c")
    assert [d.event.sample_index for d in got] == [1]
    dead = [d.event for d in bus.read_all("dead")]
    assert len(dead) == 2 and all(isinstance(e, DeadLettered) for e in dead)
    assert "not msgpack" in dead[0].error and dead[0].stream == "prompts"
    assert dead[1].fields == {"hello": "world"} and "no 'type'" in dead[1].error
    assert bus.group_lag("prompts", "g") == (0, 1)  # only the good one is pending


def test_an_event_on_a_stream_that_does_not_carry_it_is_dead_lettered_without_its_ids(bus):
    bus.ensure_group("grades", "reward")
    bus.publish("grades", prompt(0), rollout_id="r0", group_id="g0")  # a PromptIssued is no grade
    assert bus.consume("grades", "reward", "c") == []
    (dead,) = bus.read_all("dead")
    assert dead.event.error == ("PromptIssued does not belong on grades "
                                "(it carries GradeReported, GradingFailed)")
    # no part of rollout r0's work: its dead letter must not drop r0 from its group
    assert (dead.envelope.rollout_id, dead.envelope.group_id) == (None, None)


def test_a_dead_letter_shows_a_huge_entry_cut(bus):
    bus.ensure_group("prompts", "g")
    huge = {"type": "PromptIssued", "v": "1", "body": b"\xff" * 2_000_000}
    bus.redis.xadd(bus.keys.stream("prompts"), huge)
    assert bus.consume("prompts", "g", "c") == []
    (dead,) = bus.read_all("dead")
    assert len(dead.event.fields["body"]) < 70_000 and dead.event.fields["body"].endswith("characters]")


def test_entry_failing_every_delivery_is_dead_lettered_with_the_error(bus):
    bus.publish("prompts", prompt(3))
    attempts = []

    def handle(delivery):
        attempts.append(delivery.entry_id)
        raise ValueError("handler is broken")

    deadline = time.monotonic() + 10
    run_consumer(bus, ConsumerGroup("g", ("prompts",)), "c", handle,
                 should_stop=lambda: bool(bus.read_all("dead")) or time.monotonic() > deadline)
    dead = bus.read_all("dead")
    assert len(dead) == 1
    assert len(attempts) == bus.settings.max_deliveries
    assert "handler is broken" in dead[0].event.error
    assert dead[0].event.deliveries == bus.settings.max_deliveries + 1
    assert bus.group_lag("prompts", "g") == (0, 0)
