"""The consumer map: which service's group reads which stream.

    python -m pytest tests/unit/shared/contract/test_consumers.py -q
"""

from __future__ import annotations

import pytest

from rollstream.shared.contract.bus import STREAMS
from rollstream.shared.contract.consumers import (
    CONSUMER_GROUPS,
    ConsumerGroup,
    consumer_group,
    groups_reading,
    stream_groups,
    unconsumed_streams,
)
from rollstream.shared.contract.events import STREAM_EVENTS


def test_every_stream_is_consumed_by_a_group_but_the_two_that_are_only_watched():
    read = {stream for stream, _ in stream_groups()}
    # `policy` is watched (the dispatcher's XREAD), `rewards` read by people and audits: neither is consumed
    assert read == set(STREAMS) - {"policy", "rewards"}
    assert unconsumed_streams() == ("rewards", "policy")
    assert set(STREAM_EVENTS) == set(STREAMS)


def test_the_reward_service_reads_the_dead_letters_so_a_lost_rollout_is_dropped_not_waited_for():
    assert consumer_group("reward").streams == ("grades", "trajectories", "dead")
    assert groups_reading("dead") == ("reward",)
    assert set(groups_reading("trajectories")) == {"sandbox-grader", "reward"}


def test_a_group_is_named_after_its_service_and_says_what_it_reads_for():
    assert all(name == group.name and group.reads_for for name, group in CONSUMER_GROUPS.items())


def test_asking_for_a_service_that_consumes_nothing_names_those_that_do():
    with pytest.raises(ValueError,
                       match="'dispatcher' reads no stream.*agent-runner, sandbox-grader, reward, trainer"):
        consumer_group("dispatcher")


def test_a_group_must_read_streams_that_exist():
    with pytest.raises(ValueError, match="must read streams among"):
        ConsumerGroup("g", ("prompt",))
    with pytest.raises(ValueError, match="must read streams among"):
        ConsumerGroup("g", ())
