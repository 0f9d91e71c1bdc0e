"""A finished rollout as events: what an agent-runner episode and a finished gateway session both publish.

A rollout is one or more `Segment`s (trainable samples, each with the turns and tool calls that made it) and
how it ended (`RolloutFinish`). `publish_rollout` queues its events on `trajectories`: TrajectoryStarted; for
each segment a TrajectoryTurn per generation, a TrajectoryTool per tool call, then its TrajectorySegment; then
TrajectoryFinished. They go on the caller's Redis transaction, so that they are published together or not at
all: the agent-runner executes it before it acknowledges the prompt, the gateway in the transaction that
finishes the session.

Every execution of a rollout is an attempt of its own (a reclaimed prompt runs again), and every event id says
which rollout, attempt, segment and turn the event is: `{rollout}:{attempt}:started`,
`{rollout}:{attempt}:turn:{segment}:{turn}`, `{rollout}:{attempt}:tool:{segment}:{call_id}`,
`{rollout}:{attempt}:segment:{segment}` and `{rollout}:{attempt}:finished`. Segments and turns are numbered
by their place in the rollout, whatever their producer called them. Each segment carries its role (the
policy that sampled it): one rollout's segments may belong to several roles.

    python -m pytest tests/unit/shared/contract/test_rollouts.py -q
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import (
    SampleGrading,
    Status,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
)

ATTEMPT_ID_CHARS = 12


@dataclass
class Segment:
    """One trainable sample of a rollout, as its producer built it (an agent loop, or a gateway session's
    conversation); `loss_mask` and `rollout_logprobs` are aligned with `tokens`."""

    tokens: list[int]
    prompt_length: int
    loss_mask: list[int]
    rollout_logprobs: list[float]
    turn_policy_versions: list[int]
    status: str
    response_text: str
    """The final answer's text (what rule-based rewards read)."""
    turns: list[TrajectoryTurn] = field(default_factory=list)
    tools: list[TrajectoryTool] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    role: str | None = None
    """The role whose policy sampled its turns (shared/contract/roles.py); None: the run's default role."""

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length


@dataclass(frozen=True)
class RolloutFinish:
    """How a rollout ended: what its TrajectoryFinished says besides its grading and its segment count."""

    status: Status
    response_text: str
    """The final answer's text."""
    reward: float | None = None
    """A reward the episode's own environment gave, if any."""
    artifacts: dict[str, str] = field(default_factory=dict)
    error: str | None = None


def publish_rollout(bus: Bus, pipe, ids: Mapping[str, str | None], grading: SampleGrading,
                    segments: Sequence[Segment], finish: RolloutFinish, *, metadata: Mapping[str, Any],
                    server_url: str | None) -> str:
    """Queue every event of the rollout on `pipe` (a transaction the caller executes) and return the attempt.

    ids: the envelope ids (trajectory_id, rollout_id, group_id, session_id). grading: the sample's; only its
    SampleGrading fields are read. metadata: what each segment's metadata holds under the segment's own keys.
    server_url: the server TrajectoryStarted names."""
    attempt = uuid.uuid4().hex[:ATTEMPT_ID_CHARS]
    prefix = f"{ids['rollout_id']}:{attempt}"
    sample = SampleGrading.of(grading)
    publish = functools.partial(bus.publish, "trajectories", pipe=pipe, **ids)
    publish(TrajectoryStarted(sample_index=sample.sample_index, server_url=server_url),
            event_id=f"{prefix}:started")
    for index, segment in enumerate(segments):
        for number, turn in enumerate(segment.turns):
            publish(turn.model_copy(update={"turn": number, "segment_index": index}),
                    event_id=f"{prefix}:turn:{index}:{number}")
        for call in segment.tools:
            publish(call, event_id=f"{prefix}:tool:{index}:{call.call_id}")
        publish(TrajectorySegment(segment_index=index, attempt=attempt, tokens=segment.tokens,
                                  response_length=segment.response_length, loss_mask=segment.loss_mask,
                                  rollout_logprobs=segment.rollout_logprobs,
                                  turn_policy_versions=segment.turn_policy_versions, status=segment.status,
                                  response_text=segment.response_text, sample_index=sample.sample_index,
                                  group_size=sample.group_size, metadata={**metadata, **segment.metadata},
                                  role=segment.role),
                event_id=f"{prefix}:segment:{index}")
    publish(TrajectoryFinished(**dict(sample), status=finish.status, attempt=attempt,
                               segment_count=len(segments), response_text=finish.response_text,
                               reward=finish.reward, artifacts=dict(finish.artifacts), error=finish.error),
            event_id=f"{prefix}:finished")
    return attempt
