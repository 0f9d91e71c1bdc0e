"""The agent's stage: a rollout as its producer (an agent-runner episode, a finished gateway session) records
it on `trajectories`: TrajectoryStarted, a TrajectoryTurn per generation and a TrajectoryTool per tool call,
a TrajectorySegment per trainable sample, then TrajectoryFinished (shared/contract/rollouts.py publishes
them together).

    python -m pytest tests/unit/shared/contract/test_events.py -q
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rollstream.shared.contract.event_models import Count, Event, Finite, Index
from rollstream.shared.contract.event_models.prompts import SampleGrading, SampleSlot
from rollstream.shared.contract.token_arrays import Floats, Mask, TokenIds

Status = Literal["completed", "truncated", "aborted", "failed"]


class TrajectoryStarted(Event):
    """The first event of a rollout's attempt (stream `trajectories`), published with the rest of the rollout
    by the agent-runner (an episode) or the gateway (a finished session), see rollouts.py. The
    `sandbox-grader` and `reward` groups pass it over; `rollstream inspect` shows it."""

    TYPE = "TrajectoryStarted"
    sample_index: Index
    """The sample's place in the run's admission order (SampleSlot.sample_index)."""
    server_url: str | None = None
    """The vLLM server of the first turn (of the last segment, for an episode); None when there was no
    turn."""


class TrajectoryTurn(Event):
    """One generation: the ids the engine sampled, as sampled, with their logprobs.

    A segment's tokens are the concatenation, over its turns, of `appended_ids` then
    `response_ids` (`offset` is where the response starts in the segment).

    On stream `trajectories`, published by the agent-runner or the gateway (rollouts.py). The
    `sandbox-grader` and `reward` groups pass it over; `rollstream inspect` shows it.
    """

    TYPE = "TrajectoryTurn"
    turn: Index
    """Its number in its segment, from 0."""
    segment_index: Index = 0
    """The segment it belongs to (TrajectorySegment.segment_index)."""
    offset: Index
    """Index in the segment's `tokens` of the first of `response_ids`."""
    appended_ids: TokenIds
    """Tokens added since the previous turn: the prompt, or tool observations and template glue."""
    response_ids: TokenIds
    """The ids the engine sampled, as sampled (loss_mask 1 in the segment)."""
    logprobs: Floats
    """One per response id: its logprob as the server reported it (vLLM's logprobs_mode says before or after
    temperature and other processing)."""
    policy_version: Index
    """Version the server reported before the turn."""
    policy_version_end: Index
    """Version it reported after; differs when a weight sync happened mid-turn."""
    finish_reason: str
    """Why sampling stopped: `stop` (an end-of-sequence or stop token, kept in response_ids) or `length`."""
    server_url: str
    """The vLLM server that sampled it (the last one, when a streamed turn failed over to another)."""


class TrajectoryTool(Event):
    """One tool call and what it returned to the model (stream `trajectories`). Published by the agent-runner
    for its agent loops' calls (rollouts.py); the `sandbox-grader` and `reward` groups pass it over,
    `rollstream inspect` shows it."""

    TYPE = "TrajectoryTool"
    turn: int
    """The turn (in its segment) whose response made the call; the segment is in the event id."""
    call_id: str
    """Ties the result to the call: `call_{turn}_{index}` (`call_{turn}_malformed_{index}`: one that did not
    parse)."""
    name: str
    """The tool the model called (`invalid_tool_call` for a call that did not parse)."""
    arguments: dict[str, Any]
    """The arguments the model gave, as parsed ({} for a call that did not parse)."""
    ok: bool
    """Whether the tool ran and returned a result."""
    error_kind: str | None = None
    """Why not, when not ok: `unknown_tool`, `bad_arguments`, `raised`, `timeout` or `malformed`."""
    content: str
    """The text the model saw as the result (what went wrong, when not ok), cut to
    agent.max_tool_output_chars."""


class TrajectorySegment(Event, SampleSlot):
    """One trainable sample of a rollout (slime's Sample, verl's AgentLoopOutput).

    `tokens` is the whole sequence; `loss_mask` and `rollout_logprobs` are aligned with it: 1 on
    sampled tokens, 0 on prompt, template and observation tokens (whose logprob is 0.0).

    On stream `trajectories`, published by the agent-runner or the gateway (rollouts.py). The `reward`
    group joins it with its rollout's reward into a batch row; the `sandbox-grader` group passes it over.
    """

    TYPE = "TrajectorySegment"
    VERSION = 2  # v2: role
    segment_index: Index
    """Its place in the rollout, from 0 (TrajectoryFinished.segment_count says how many)."""
    attempt: str = ""
    """Which execution of the rollout produced it (a reclaimed prompt can run twice)."""
    tokens: TokenIds
    """The whole sequence: the prompt, then each turn's response and what was appended after it."""
    response_length: int
    """How many of `tokens`, at the end, follow the prompt: responses, observations and template glue."""
    loss_mask: Mask
    """1 on the tokens the model sampled, 0 on the others."""
    rollout_logprobs: Floats
    """Each sampled token's logprob as the server reported it (TrajectoryTurn.logprobs); 0.0 on the others."""
    turn_policy_versions: list[Index]
    """Each turn's policy_version, in order: the trainer drops the segment if the oldest is too stale."""
    status: Status
    """How the segment ended; a rollout's last segment ended as the rollout did
    (TrajectoryFinished.status)."""
    response_text: str
    """The text of the segment's final answer."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The prompt's metadata and what its producer adds (e.g. `turns`, `tool_calls`, `error`); kept in the
    batch."""
    role: str | None = None
    """The role whose policy sampled its turns (roles.names; shared/contract/roles.py), which trains on it;
    each turn's policy_version is that role's. None: the run's default role (every segment recorded before
    roles existed)."""

    @model_validator(mode="after")
    def _aligned(self) -> TrajectorySegment:
        n = len(self.tokens)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"tokens ({n}), loss_mask ({len(self.loss_mask)}) and rollout_logprobs "
                f"({len(self.rollout_logprobs)}) must have the same length"
            )
        if not 0 <= self.response_length <= n:
            raise ValueError(f"response_length {self.response_length} outside 0..{n}")
        return self


class TrajectoryFinished(Event, SampleGrading):
    """The rollout is over; `segment_count` segments were published for it. The last of its events on stream
    `trajectories`, published by the agent-runner or the gateway (rollouts.py). The `sandbox-grader` group
    queues a grading job for it when it needs_grade; the `reward` group scores it (with that grade)."""

    TYPE = "TrajectoryFinished"
    status: Status
    """completed (the model answered), truncated (a turn, token or time budget ran out), aborted (only a
    gateway session's finish says so) or failed (an error: never graded, rewarded 0)."""
    attempt: str = ""
    """Which execution of the rollout this closes; its segments carry the same attempt."""
    segment_count: Count
    """A rollout has at least one segment (the agent-runner refuses an agent that returns none)."""
    response_text: str = ""
    """The final answer's text, for rule-based rewards."""
    reward: Finite | None = None
    """A reward the episode's own environment gave (a gateway session finished with one); used when no
    sandbox grades the rollout, instead of reward_fn."""
    artifacts: dict[str, str] = Field(default_factory=dict)
    """What the episode left in storage, by name (e.g. "diff" of a coding episode)."""
    error: str | None = None
    """Why it failed or was cut short, where known: the agent loop's error, a command's exit and output
    tail."""

    @property
    def needs_grade(self) -> bool:
        """Graded in a sandbox (by a check or by a task's tests), not by a rule."""
        return bool(self.sandbox_check or self.grader) and self.status != "failed"
