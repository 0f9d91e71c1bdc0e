"""The event schema: the one contract between rollstream's services, gathered in one place.

Every fact a service publishes is a versioned pydantic model, wrapped in an `Envelope` (type, schema version,
event id, run id, time, and the ids it belongs to) and put on one of the run's Redis streams as three fields:
`type`, `v` (schema version) and `body`, a msgpack document. The contract is made of:

- the events, one module per stage of the pipeline (event_models/): prompts.py, trajectories.py, grades.py,
  rewards.py, policy.py, dead_letters.py; each event class says who publishes it and who reads it: the
  consumer groups of its stream (consumers.py) and the readers outside them. Besides those, the recorder
  archives every stream, and `rollstream replay` re-publishes a recorded run;
- the streams and the events each carries (streams.py: `STREAM_EVENTS`);
- the envelope around every event (envelope.py);
- the codec between an envelope and a stream entry's fields (codec.py), with its fast path
  (event_structs.py) and the packed token arrays (token_arrays.py); a decode failure is an
  `EventDecodeError` that says why.

Services import all of it from here; the names below are the contract.

    python -m pytest tests/unit/shared/contract -q
"""

from __future__ import annotations

from rollstream.shared.contract.codec import decode, decode_on, encode, encode_event
from rollstream.shared.contract.envelope import ENVELOPE_IDS, Envelope, make_envelope
from rollstream.shared.contract.event_models import Count, Event, Finite, Index
from rollstream.shared.contract.event_models.dead_letters import DeadLettered
from rollstream.shared.contract.event_models.grades import GradeReported, GradingFailed
from rollstream.shared.contract.event_models.policy import PolicyUpdated
from rollstream.shared.contract.event_models.prompts import Grading, PromptIssued, SampleGrading, SampleSlot
from rollstream.shared.contract.event_models.rewards import BatchReady, RewardAssigned, RolloutDropped
from rollstream.shared.contract.event_models.trajectories import (
    Status,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
)
from rollstream.shared.contract.streams import EVENT_TYPES, STREAM_EVENTS, STREAMS, StreamName
from rollstream.shared.errors import EventDecodeError

__all__ = [
    # the events, by stage, and the field types they share
    "Event", "Count", "Index", "Finite",
    "SampleSlot", "Grading", "SampleGrading", "PromptIssued",
    "Status", "TrajectoryStarted", "TrajectoryTurn", "TrajectoryTool", "TrajectorySegment",
    "TrajectoryFinished",
    "GradeReported", "GradingFailed",
    "RewardAssigned", "RolloutDropped", "BatchReady",
    "PolicyUpdated",
    "DeadLettered",
    # the streams and the events each carries
    "StreamName", "STREAMS", "STREAM_EVENTS", "EVENT_TYPES",
    # the envelope
    "Envelope", "ENVELOPE_IDS", "make_envelope",
    # the codec
    "encode", "encode_event", "decode", "decode_on", "EventDecodeError",
]
