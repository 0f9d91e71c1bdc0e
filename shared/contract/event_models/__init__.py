"""The event models, one module per stage of the pipeline, in the order a sample goes through it:

- prompts.py: the dispatcher admits a sample (PromptIssued), with the per-sample fields that travel with it;
- trajectories.py: an agent-runner or the gateway records its rollout (TrajectoryStarted ... Finished);
- grades.py: a sandbox grades it, or cannot (GradeReported, GradingFailed);
- rewards.py: the reward service scores it and batches its group (RewardAssigned, RolloutDropped,
  BatchReady);
- policy.py: the trainer trains on the batch and the fleet serves the new version (PolicyUpdated);
- dead_letters.py: the bus gives up an entry no consumer could handle (DeadLettered).

Here: `Event`, the base of every event, and the field types the stages share. Which stream carries which
event is streams.py; the contract as a whole (the events, the streams, the envelope, the codec) is gathered
in shared/contract/events.py.

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import BaseModel, ConfigDict, Field

Count = Annotated[int, Field(ge=1)]
"""A number of things that exist at least once (samples in a group, segments of a rollout)."""
Index = Annotated[int, Field(ge=0)]
"""A position or a version: never negative."""
Finite = Annotated[float, Field(allow_inf_nan=False)]
"""A score, reward or advantage: NaN or infinity would poison every mean and gradient it reaches."""


class Event(BaseModel):
    """Base of every event payload. `TYPE` names it on the wire, `VERSION` is its schema version.

    A version that adds fields (each with a default) still reads the entries of the versions before it, from
    FIRST_VERSION on: runs recorded by an earlier rollstream replay, their new fields at their defaults. A
    change that is not such an addition starts a new FIRST_VERSION."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    TYPE: ClassVar[str]
    VERSION: ClassVar[int] = 1
    FIRST_VERSION: ClassVar[int] = 1
