"""The event schema: the one contract between rollstream's services.

Every fact a service publishes is one of the versioned pydantic models below, wrapped in an
`Envelope` (type, schema version, event id, run id, time, and the ids it belongs to). On a Redis
stream an event is three fields: `type`, `v` (schema version) and `body`, a msgpack document.
Token ids and logprobs travel as packed little-endian int32 / float32 bytes inside that document, and a
model holds them so, as a read-only list-like PackedArray (token_arrays.py): decoding never unpacks them.
`python bench/bench_encoding.py` measures this against JSON lists (smaller and faster to decode).

Decoding rejects, with an `EventDecodeError` that says why, an unknown type, an unknown schema
version, and a payload that does not validate: besides the field types, counts and indices that
cannot be negative (a group of 0 samples, a rollout of 0 segments), scores and rewards that are not
finite, and token arrays longer than MAX_SEQUENCE_TOKENS (token_arrays.py), so that one entry cannot make a
reader allocate without bound. It checks a body with msgspec Structs generated from these models, in C, and
asks the models' own validation only about a body that those refuse (event_structs.py). `STREAM_EVENTS` says
which event types belong on which stream.

Each event class says who publishes it and who reads it: the consumer groups of its stream (consumers.py)
and the readers outside them. Besides those, the recorder archives every stream, and `rollstream replay`
re-publishes a recorded run.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import msgspec
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from rollstream.shared.contract.event_ids import new_event_id
from rollstream.shared.contract.event_structs import FLOAT_MAX, fast_decoder, validated_model
from rollstream.shared.contract.token_arrays import Floats, Mask, TokenIds, packed_bytes
from rollstream.shared.errors import EventDecodeError

Count = Annotated[int, Field(ge=1)]
"""A number of things that exist at least once (samples in a group, segments of a rollout)."""
Index = Annotated[int, Field(ge=0)]
"""A position or a version: never negative."""
Finite = Annotated[float, Field(allow_inf_nan=False)]
"""A score, reward or advantage: NaN or infinity would poison every mean and gradient it reaches."""

Status = Literal["completed", "truncated", "aborted", "failed"]


class Event(BaseModel):
    """Base of every event payload. `TYPE` names it on the wire, `VERSION` is its schema version."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    TYPE: ClassVar[str]
    VERSION: ClassVar[int] = 1


Payload = TypeVar("Payload", bound=Event)


# gc=False: the collector need not track an envelope, which can be in no cycle (it holds the wire's data)
class Envelope(msgspec.Struct, Generic[Payload], frozen=True, kw_only=True, forbid_unknown_fields=True,
               gc=False):
    """What every stream entry carries around its payload. `Envelope[SomeEvent]` checks its payload as that
    event class (how decode() checks an entry in one pass); every envelope is of the one class `Envelope`.

    A msgspec Struct, not a model like its payload: every entry a service reads makes one, and a Struct costs
    a fraction of a model to make. msgspec checks its fields where it decodes one (decode()); make_envelope()
    checks the ids it is given."""

    type: str
    """The payload's event type (its TYPE), as the entry's `type` field also says."""
    schema_version: int
    """The payload's schema version (its VERSION), as the entry's `v` field also says."""
    event_id: str
    """Unique per event: derived from what it is where a handler may publish it twice (e.g.
    `{rollout}:{attempt}:finished`, `{rollout}:reward`, `policy:v{version}`), else 32 hex digits unique to
    the process and the event (event_ids.py)."""
    run_id: str
    """The run it belongs to (its namespace in Redis and its folder in run storage)."""
    time: Annotated[float, msgspec.Meta(ge=-FLOAT_MAX, le=FLOAT_MAX)]
    """When it was published: Unix time in seconds on the publisher's clock; finite (readers bucket by it)."""
    trajectory_id: str | None = None
    """The trajectory it records: the rollout id, unless a gateway session was created with another;
    None, like the other ids, for an event of no rollout (BatchReady, PolicyUpdated)."""
    rollout_id: str | None = None
    """The rollout (one admitted sample, `{run}-r{sample_index:07d}` from the dispatcher) it is about."""
    group_id: str | None = None
    """Its prompt group (`{run}-g{group_index:06d}` from the dispatcher): rewards are relative within it."""
    session_id: str | None = None
    """What its generations are routed by (one server keeps the prefix cache): the rollout id, or the gateway
    session's id."""
    payload: Payload
    """The event itself, of the class `type` names."""

    def to_json(self) -> dict[str, Any]:
        """The envelope as JSON values, its payload as its model dumps it (token arrays as lists)."""
        return {**msgspec.structs.asdict(self), "payload": self.payload.model_dump(mode="json")}


# ----------------------------------------------------------------------------------------- samples
class SampleSlot(BaseModel):
    """Which sample of its prompt group a rollout is."""

    sample_index: Index
    """Position of this sample in the run's admission order (0-based)."""
    group_size: Count
    """Samples in this prompt group (n)."""


class Grading(BaseModel):
    """How a sample's answer is graded: by a built-in rule against its label, or by a check in a sandbox."""

    label: str | None = None
    """Reference answer for rule-based rewards."""
    reward_fn: str = "exact_match"
    """Name of the built-in reward function."""
    sandbox_check: str | None = None
    """Shell command whose exit status grades the sample in a sandbox; None: no sandbox grade."""


class SampleGrading(SampleSlot, Grading):
    """Every per-sample grading field: the sample's place in its group and how it is graded, a task's grader
    included. TrajectoryFinished carries them, and a gateway session is created with them. A prompt
    (PromptIssued, and the dataset row it comes from) has the same, but keeps its grader in
    `metadata["grader"]`, where the agent's sandbox reads it too."""

    grader: dict[str, Any] = Field(default_factory=dict)
    """A task whose tests grade the rollout's diff: {"kind": "harbor" | "swebench", ...}."""

    @staticmethod
    def of(source: Any) -> SampleGrading:
        """These fields of anything that has them as attributes: a prompt, a session's spec, a request."""
        return SampleGrading(**{name: getattr(source, name) for name in SampleGrading.model_fields})


# ----------------------------------------------------------------------------------------- prompts
class PromptIssued(Event, SampleSlot, Grading):
    """The dispatcher admitted one sample of a prompt group (stream `prompts`). The `agent-runner` group reads it
    and runs the sample's episode (a black-box one through a gateway session); `rollstream inspect` shows it."""

    TYPE = "PromptIssued"
    messages: list[dict[str, Any]]
    """Chat messages of the prompt (role, content)."""
    agent: str | None = None
    """Agent loop: a registered name or package.module:function; None: the configured default."""
    tools: list[str] = Field(default_factory=list)
    """Tools the episode may call: registered names or package.module:attr."""
    policy_version: Index
    """The policy version the dispatcher saw when it admitted the sample."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The dataset row's map (e.g. `grader`, `repo`, `time_budget_s`), for the agent loop and its tools; every
    segment's metadata starts from it."""

    @property
    def grader(self) -> dict[str, Any]:
        """The task's grader (SampleGrading.grader), which a prompt carries in its metadata."""
        return dict(self.metadata.get("grader") or {})


# ------------------------------------------------------------------------------------ trajectories
class TrajectoryStarted(Event):
    """The first event of a rollout's attempt (stream `trajectories`), published with the rest of the rollout by
    the agent-runner (an episode) or the gateway (a finished session), see rollouts.py. The `sandbox-grader` and
    `reward` groups pass it over; `rollstream inspect` shows it."""

    TYPE = "TrajectoryStarted"
    sample_index: Index
    """The sample's place in the run's admission order (SampleSlot.sample_index)."""
    server_url: str | None = None
    """The vLLM server of the first turn (of the last segment, for an episode); None when there was no turn."""


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
    for its agent loops' calls (rollouts.py); the `sandbox-grader` and `reward` groups pass it over, `rollstream
    inspect` shows it."""

    TYPE = "TrajectoryTool"
    turn: int
    """The turn (in its segment) whose response made the call; the segment is in the event id."""
    call_id: str
    """Ties the result to the call: `call_{turn}_{index}` (`call_{turn}_malformed_{index}`: one that did not parse)."""
    name: str
    """The tool the model called (`invalid_tool_call` for a call that did not parse)."""
    arguments: dict[str, Any]
    """The arguments the model gave, as parsed ({} for a call that did not parse)."""
    ok: bool
    """Whether the tool ran and returned a result."""
    error_kind: str | None = None
    """Why not, when not ok: `unknown_tool`, `bad_arguments`, `raised`, `timeout` or `malformed`."""
    content: str
    """The text the model saw as the result (what went wrong, when not ok), cut to agent.max_tool_output_chars."""


class TrajectorySegment(Event, SampleSlot):
    """One trainable sample of a rollout (slime's Sample, verl's AgentLoopOutput).

    `tokens` is the whole sequence; `loss_mask` and `rollout_logprobs` are aligned with it: 1 on
    sampled tokens, 0 on prompt, template and observation tokens (whose logprob is 0.0).

    On stream `trajectories`, published by the agent-runner or the gateway (rollouts.py). The `reward`
    group joins it with its rollout's reward into a batch row; the `sandbox-grader` group passes it over.
    """

    TYPE = "TrajectorySegment"
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
    """How the segment ended; a rollout's last segment ended as the rollout did (TrajectoryFinished.status)."""
    response_text: str
    """The text of the segment's final answer."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    """The prompt's metadata and what its producer adds (e.g. `turns`, `tool_calls`, `error`); kept in the batch."""

    @model_validator(mode="after")
    def _aligned(self) -> "TrajectorySegment":
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
    """completed (the model answered), truncated (a turn, token or time budget ran out), aborted (only a gateway
    session's finish says so) or failed (an error: never graded, rewarded 0)."""
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
    """Why it failed or was cut short, where known: the agent loop's error, a command's exit and output tail."""

    @property
    def needs_grade(self) -> bool:
        """Graded in a sandbox (by a check or by a task's tests), not by a rule."""
        return bool(self.sandbox_check or self.grader) and self.status != "failed"


# ------------------------------------------------------------------------------- grades and rewards
class GradeReported(Event):
    """A sandbox ran the task's check on the rollout (stream `grades`). Published by the sandbox-grader's job;
    the `reward` group makes its score the rollout's reward; `rollstream inspect` shows it."""

    TYPE = "GradeReported"
    score: Finite
    """0 to 1: 1 when the check exited 0 or the task's tests passed (a task's verifier may give a fraction)."""
    passed: bool
    """Whether score is 1."""
    reason: str
    """The outcome in words: the check's exit (e.g. `exit 1`), the tests' verdict, or why it scored 0."""
    duration_s: Finite
    """Wall-clock seconds the grading took, set-up included."""
    log_uri: str | None = None
    """Path in run storage of what the check or the tests printed (`<run>/sandbox-logs/<rollout>.log`)."""
    tests: dict[str, str] = Field(default_factory=dict)
    """Per-test outcome (passed, failed, error, skipped) where the task's tests report them."""


class GradingFailed(Event):
    """The sandbox could not grade the rollout (stream `grades`): its backend cannot run here, the
    task's files or image could not be prepared, the worker died under the job, or every retry met
    an infrastructure error. Published by the sandbox-grader (its job, or its sweep of jobs that died).
    This is not a grade and never becomes a reward: the `reward` group leaves the rollout out of its
    group's batch and counts it (its sample slot is given back to the dispatcher). Whatever the
    rollout's own code did, time-outs and crashes included, is a GradeReported instead, so a policy
    cannot turn bad attempts into unpunished failures."""

    TYPE = "GradingFailed"
    reason: str
    """Why, with the error: `cannot be graded: ...` (no retry could help) or `grading failed and no retry
    is left: ...`."""
    attempts: int
    """How many times the job ran before it was given up."""


class RewardAssigned(Event):
    """A rollout's reward and its group-relative advantage (stream `rewards`), published by the reward service when
    the rollout's group is complete. No consumer group reads `rewards` (the batch carries the same values):
    `rollstream inspect` and the chaos audits do."""

    TYPE = "RewardAssigned"
    reward: Finite
    """The rollout's reward, the same for all its segments: its grade's score, a reward function's, or a given one."""
    advantage: Finite
    """Its reward relative to the rest of its group (train.advantage_estimator: grpo or dr_grpo)."""
    source: str
    """Which reward produced it: a reward function's name (reward.function's or the prompt's), `sandbox`,
    `given` (TrajectoryFinished.reward), or `failed` (a failed rollout's 0)."""


class RolloutDropped(Event):
    """A rollout that will never be in a batch, and why (stream `rewards`): its grading failed, an event
    it needed was dead-lettered, its grade did not come within reward.grade_timeout_s, or its group
    was filtered out (no reward variance). Its sample slot goes back to the dispatcher. Published by the reward
    service; no consumer group reads `rewards`: the chaos audits do."""

    TYPE = "RolloutDropped"
    reason: str
    """What happened, with the error or the timeout where there is one."""
    cause: Literal["grading_failed", "dead_lettered", "grade_timeout", "filtered"]
    """The reason's kind, as counted in the reward service's /healthz `rollouts_dropped`."""


class BatchReady(Event):
    """A reward-complete Parquet batch is in storage (stream `batches`); mean_reward is over its rollouts.
    Published by the reward service; the `trainer` group trains on it, reading the file at `uri` (batches.py)."""

    TYPE = "BatchReady"
    batch_id: str
    """`b-` and a digest of its group ids: the same groups make the same batch, which is trained once."""
    uri: str
    """Path of the Parquet file in run storage (`<run>/batches/<batch_id>.parquet`)."""
    sample_count: Count
    """Rows in the file: one per trainable segment of its rollouts."""
    group_ids: list[str]
    """The prompt groups it holds, each whole, in batch order."""
    min_policy_version: Index
    """The oldest policy version any of its turns was sampled with."""
    mean_reward: Finite
    """Mean reward of its rollouts, each counted once whatever its segments."""


class PolicyUpdated(Event):
    """The fleet serves a new policy version, checked for logprob parity (stream `policy`). Published by the
    trainer for each batch it trained. No consumer group reads `policy`: the dispatcher watches it for the
    version that lets it admit more, a restarted trainer resumes from its own last one, `rollstream inspect`
    shows it."""

    TYPE = "PolicyUpdated"
    version: Index
    """The new version: one more than the last (0 is the starting model)."""
    checkpoint_uri: str
    """Local directory of its training state (the weights the fleet loads, optimizer, RNG): `<run>/checkpoints/v<n>`."""
    batch_id: str
    """The batch (BatchReady.batch_id) it was trained on."""
    servers: list[str]
    """URLs of the vLLM servers that loaded it."""
    parity_max_abs_diff: float
    """Largest absolute difference, over the servers, between their prompt logprobs of a probe and the trainer's."""
    loss: float
    """The step's training loss (metrics["train/loss"]; 0.0 when no row had a sampled token)."""
    trained_samples: int
    """Batch rows (segments) trained on, those dropped left out."""
    dropped: dict[str, int] = {}
    """Samples of the batch left out of training, by reason (`stale`: older than train.max_staleness; `invalid`:
    rows no model can train on)."""
    metrics: dict[str, float] = {}
    """The step's training metrics (loss terms, importance weights, staleness, timings), as tracked."""

    @model_validator(mode="before")
    @classmethod
    def _without_the_old_stale_count(cls, data: Any) -> Any:
        # Runs recorded before it was removed carry `dropped_stale`, a copy of dropped["stale"]: their
        # archives must still replay and inspect.
        if isinstance(data, dict) and "dropped_stale" in data:
            return {key: value for key, value in data.items() if key != "dropped_stale"}
        return data


class DeadLettered(Event):
    """An entry that could not be handled (stream `dead`). Published by the bus for the consumer group that gave
    it up (Bus.dead_letter), with the entry's ids when it decoded. The `reward` group drops the rollout of a
    dead-lettered prompt, trajectory or grade event; `rollstream run` and the chaos audits report it."""

    TYPE = "DeadLettered"
    stream: str
    """The stream the entry was on."""
    entry_id: str
    """Its Redis stream entry id there."""
    group: str
    """The consumer group that gave it up."""
    deliveries: int
    """How many times the group was handed it (1: refused at once, e.g. an entry that does not decode)."""
    error: str
    """Why: the decode error, the handler's last error after bus.max_deliveries, or the service's own reason."""
    fields: dict[str, str]
    """The original entry's fields, bytes shown as repr where not UTF-8."""


EVENT_TYPES: dict[str, type[Event]] = {cls.TYPE: cls for cls in (
    PromptIssued, TrajectoryStarted, TrajectoryTurn, TrajectoryTool, TrajectorySegment, TrajectoryFinished,
    GradeReported, GradingFailed, RewardAssigned, RolloutDropped, BatchReady, PolicyUpdated, DeadLettered)}

StreamName = Literal["prompts", "trajectories", "grades", "rewards", "batches", "policy", "dead"]
STREAMS: tuple[StreamName, ...] = ("prompts", "trajectories", "grades", "rewards", "batches", "policy", "dead")
"""The run's streams; who reads each through a consumer group is shared/contract/consumers.py."""

STREAM_EVENTS: dict[StreamName, tuple[type[Event], ...]] = {
    "prompts": (PromptIssued,),
    "trajectories": (TrajectoryStarted, TrajectoryTurn, TrajectoryTool, TrajectorySegment, TrajectoryFinished),
    "grades": (GradeReported, GradingFailed),
    "rewards": (RewardAssigned, RolloutDropped),
    "batches": (BatchReady,),
    "policy": (PolicyUpdated,),
    "dead": (DeadLettered,),
}
"""The event types each stream carries; anything else on a stream is misplaced (its consumer cannot
tell what it means), and is dead-lettered rather than passed over."""


def make_envelope(payload: Event, *, run_id: str, event_id: str | None = None,
                  trajectory_id: str | None = None, rollout_id: str | None = None, group_id: str | None = None,
                  session_id: str | None = None) -> Envelope:
    """Wrap a payload. Pass a deterministic `event_id` where a handler may run twice. The ids must be str or
    None, as the Envelope's fields say (a TypeError names the one that is not)."""
    return Envelope(**_head(payload, run_id, event_id, trajectory_id, rollout_id, group_id, session_id))


def _head(payload: Event, run_id: str, event_id: str | None, trajectory_id: str | None,
          rollout_id: str | None, group_id: str | None, session_id: str | None) -> dict[str, Any]:
    """A new envelope's fields, in the Envelope's order; a TypeError for an argument no envelope holds."""
    if not (type(payload) in _WIRE_VERSIONS and type(run_id) is str and type(event_id) in _IDS
            and type(trajectory_id) in _IDS and type(rollout_id) in _IDS and type(group_id) in _IDS
            and type(session_id) in _IDS):
        _check_types(payload, run_id, event_id=event_id, trajectory_id=trajectory_id, rollout_id=rollout_id,
                     group_id=group_id, session_id=session_id)
    return {"type": payload.TYPE, "schema_version": payload.VERSION,
            "event_id": event_id or new_event_id(), "run_id": run_id, "time": time.time(),
            "trajectory_id": trajectory_id, "rollout_id": rollout_id, "group_id": group_id,
            "session_id": session_id, "payload": payload}


_encoder = msgspec.msgpack.Encoder(enc_hook=packed_bytes)
_decoder = msgspec.msgpack.Decoder()


def encode(envelope: Envelope) -> dict[str, bytes | str]:
    """Stream fields for an envelope."""
    return _fields(msgspec.structs.asdict(envelope))


def encode_event(payload: Event, *, run_id: str, event_id: str | None = None,
                 trajectory_id: str | None = None, rollout_id: str | None = None, group_id: str | None = None,
                 session_id: str | None = None) -> dict[str, bytes | str]:
    """encode(make_envelope(...)) without making the Envelope, which costs a small event's publisher more
    than the rest of its encoding (Bus.publish's path), with make_envelope's checks."""
    return _fields(_head(payload, run_id, event_id, trajectory_id, rollout_id, group_id, session_id))


_IDS = frozenset((str, type(None)))


def _check_types(payload: Event, run_id: str, **ids: str | None) -> None:
    """A TypeError naming the argument no envelope holds; none for an Event subclass outside
    EVENT_TYPES, which fails _head's quick check but encodes all the same."""
    if not isinstance(payload, Event):
        raise TypeError(f"the payload must be an Event, not {type(payload).__name__}")
    for name, value in {"run_id": run_id, **ids}.items():
        if type(value) is not str and (value is not None or name == "run_id"):  # msgpack has no str subclass
            raise TypeError(f"{name} must be a str{'' if name == 'run_id' else ' or None'}, "
                            f"not {type(value).__name__}")


def _fields(head: dict[str, Any]) -> dict[str, bytes | str]:
    """Stream fields of an envelope's fields `head` (a dict this changes: its payload becomes its fields)."""
    # Every field of the contract holds what msgpack encodes as it is (str, numbers, None, lists and maps of
    # them) or a PackedArray (its bytes: packed_bytes): the payload's fields are encoded straight from the
    # model, as its own serializer would give them in Python mode, at half the cost of asking it.
    payload = head["payload"]
    head["payload"] = payload.__dict__
    return {"type": head["type"], "v": _WIRE_VERSIONS.get(type(payload)) or str(head["schema_version"]),
            "body": _encoder.encode(head)}


def _field(fields: dict, key: bytes) -> bytes | str | None:
    # redis-py hands back bytes keys; archives and tests may hold str ones
    value = fields.get(key)
    return fields.get(key.decode()) if value is None else value


def _text(fields: dict, key: bytes) -> str | None:
    value = _field(fields, key)
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


_WIRE_VERSIONS = {cls: str(cls.VERSION) for cls in EVENT_TYPES.values()}  # each event class's `v` field
_FAST_DECODE_ENVELOPE_OF = {cls: fast_decoder(cls, Envelope) for cls in EVENT_TYPES.values()}
"""Each event class's fast path from a body to its envelope, or None where the class has none."""
# Each fast path by its entry's `type` and `v` fields as redis-py hands them back: decode's usual case
_FAST_DECODE_OF_WIRE = {(cls.TYPE.encode(), v.encode()): _FAST_DECODE_ENVELOPE_OF[cls]
                        for cls, v in _WIRE_VERSIONS.items() if _FAST_DECODE_ENVELOPE_OF[cls]}


def decode(fields: dict) -> Envelope:
    """An envelope from stream fields (bytes or str keys); EventDecodeError if it is not one."""
    fast_decode = _FAST_DECODE_OF_WIRE.get((fields.get(b"type"), fields.get(b"v")))
    if fast_decode is not None:
        envelope = fast_decode(fields.get(b"body"))  # None: _checked_decode takes it or says why not
        if envelope is not None:
            return envelope
    return _checked_decode(fields)


def _checked_decode(fields: dict) -> Envelope:
    """decode() by the checks that say what is wrong with an entry, or take what the fast path did not."""
    cls, raw = _event_class_and_body(fields)
    type_name = cls.TYPE
    try:
        body = _decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # a msgpack string of bad UTF-8 is the latter
        raise EventDecodeError(f"{type_name} body is not msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise EventDecodeError(f"{type_name} body is a {type(body).__name__}, not a map")
    try:
        envelope = msgspec.convert(body, Envelope[cls], strict=False, dec_hook=validated_model)
    except msgspec.ValidationError as exc:  # it says where: `$.run_id`, `$.payload` with the model's errors
        why = str(exc)
        if why.endswith("`$.time`"):  # msgspec words it as the bounds that keep a float finite
            why = f"time must be a finite number of seconds, not {body.get('time')!r}"
        raise EventDecodeError(f"malformed {type_name} entry: {why}") from exc
    except (TypeError, ValueError) as exc:  # an after validator's own error: the entry's, not the reader's
        raise EventDecodeError(f"malformed {type_name} body: {type(exc).__name__}: {exc}") from exc
    if envelope.type != type_name or envelope.schema_version != cls.VERSION:
        raise EventDecodeError(f"body says {envelope.type} v{envelope.schema_version}, fields say "
                               f"{type_name} v{cls.VERSION}")
    return envelope


def _event_class_and_body(fields: dict) -> tuple[type[Event], bytes]:
    """The event class an entry's `type` and `v` name, and its body; EventDecodeError saying what is wrong."""
    type_name = _text(fields, b"type")
    if type_name is None:
        raise EventDecodeError("entry has no 'type' field")
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise EventDecodeError(f"unknown event type {type_name!r}")
    version = _text(fields, b"v")
    if version != str(cls.VERSION):
        raise EventDecodeError(f"{type_name} schema version {version!r} is not supported "
                               f"(this code reads v{cls.VERSION})")
    raw = _field(fields, b"body")
    if raw is None:
        raise EventDecodeError(f"{type_name} entry has no 'body' field")
    return cls, raw.encode() if isinstance(raw, str) else raw
