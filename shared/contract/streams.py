"""The run's streams and the events each carries: the one place that says which event goes on which stream.

A stream carries only the event types STREAM_EVENTS gives it; the bus dead-letters anything else found on it
(codec.decode_on), since its consumers cannot tell what it means there. Who reads each stream through a
consumer group is consumers.py; the key of each stream is keys.py's `Keys.stream`.

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from typing import Literal, get_args

from rollstream.shared.contract.event_models import Event
from rollstream.shared.contract.event_models.dead_letters import DeadLettered
from rollstream.shared.contract.event_models.grades import GradeReported, GradingFailed
from rollstream.shared.contract.event_models.policy import PolicyUpdated
from rollstream.shared.contract.event_models.prompts import PromptIssued
from rollstream.shared.contract.event_models.rewards import BatchReady, RewardAssigned, RolloutDropped
from rollstream.shared.contract.event_models.trajectories import (
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
)

StreamName = Literal["prompts", "trajectories", "grades", "rewards", "batches", "policy", "dead"]
STREAMS: tuple[StreamName, ...] = get_args(StreamName)
"""The run's streams; who reads each through a consumer group is shared/contract/consumers.py."""

STREAM_EVENTS: dict[StreamName, tuple[type[Event], ...]] = {
    "prompts": (PromptIssued,),
    "trajectories": (TrajectoryStarted, TrajectoryTurn, TrajectoryTool, TrajectorySegment,
                     TrajectoryFinished),
    "grades": (GradeReported, GradingFailed),
    "rewards": (RewardAssigned, RolloutDropped),
    "batches": (BatchReady,),
    "policy": (PolicyUpdated,),
    "dead": (DeadLettered,),
}
"""The event types each stream carries; anything else on a stream is misplaced (its consumer cannot
tell what it means), and is dead-lettered rather than passed over."""

EVENT_TYPES: dict[str, type[Event]] = {cls.TYPE: cls for carried in STREAM_EVENTS.values() for cls in carried}
"""Every event type of the contract by its wire name (its TYPE): those the streams carry."""
