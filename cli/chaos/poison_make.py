"""Poison entries for every stream of a run: what `rollstream chaos poison` writes (the kinds, and what
each must come to, are in cli/chaos/poison.py).

`poison_plan` makes, deterministically per seed, entries of every kind for every stream (`STREAM_KINDS`
says which kinds a stream gets), in a shuffled injection order: the same arguments give the same entries,
byte for byte. Undecodable kinds are checked not to decode as they are made.

    python -m pytest tests/unit/cli/test_poison.py -q
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
import numpy as np

from rollstream.shared.contract.batches import BatchRow
from rollstream.shared.contract.bus import STREAMS, StreamName
from rollstream.shared.contract.consumers import stream_groups
from rollstream.shared.contract.events import (
    STREAM_EVENTS,
    BatchReady,
    DeadLettered,
    Envelope,
    Event,
    EventDecodeError,
    GradeReported,
    GradingFailed,
    PolicyUpdated,
    PromptIssued,
    RewardAssigned,
    RolloutDropped,
    TrajectoryFinished,
    TrajectorySegment,
    TrajectoryStarted,
    TrajectoryTool,
    TrajectoryTurn,
    decode,
    encode,
)
from rollstream.shared.runtime.storage import Storage

FORGED_DEAD_LETTER_OF: tuple[StreamName, str] = next(pair for pair in stream_groups()
                                                     if pair[0] == "prompts")
"""The (stream, group) a forged dead letter names: a prompt its agent-runner gave up on."""

GENERIC_KINDS = ("random_bytes", "truncated", "mutated", "malformed", "unknown_version", "wrong_types",
                 "invalid_payload", "oversized", "foreign_event")
"""Kinds every stream gets: what any entry on any stream may look like."""
STREAM_KINDS: dict[StreamName, tuple[str, ...]] = {
    "prompts": GENERIC_KINDS + ("huge_tokens", "unknown_agent", "missing_file", "forged"),
    "trajectories": GENERIC_KINDS + ("huge_tokens", "missing_file", "forged", "orphan_finish"),
    "grades": GENERIC_KINDS + ("forged",),
    "rewards": GENERIC_KINDS + ("forged",),
    "batches": GENERIC_KINDS + ("missing_file", "replayed_batch", "untrainable_rows", "forged"),
    "policy": GENERIC_KINDS + ("missing_file", "forged"),
    "dead": GENERIC_KINDS + ("forged",),
}
KINDS = tuple(dict.fromkeys(kind for kinds in STREAM_KINDS.values() for kind in kinds))
STALLING_KINDS = frozenset({"orphan_finish"})
"""Kinds that stall valid traffic as the services are (see cli/chaos/poison.py): asked for by name only."""
DEFAULT_KINDS = tuple(kind for kind in KINDS if kind not in STALLING_KINDS)
UNDECODABLE_KINDS = frozenset({"random_bytes", "truncated", "mutated", "malformed", "unknown_version",
                               "wrong_types", "invalid_payload", "oversized"})
"""Kinds whose entries never decode (the generator checks it): the bus dead-letters them unread."""
BUS_REJECTED_KINDS = UNDECODABLE_KINDS | {"foreign_event"}
"""Kinds the bus dead-letters before any consumer reads them: what does not decode, and what is no event
of the stream it is on."""
OVERSIZED_BYTES = 2 << 20
HUGE_TOKENS = 1_000_000
FORGED_VERSION = 1_000_000
"""The policy version a forged PolicyUpdated claims: far ahead of any run."""
LONG_ROW_TOKENS = 100_000
"""An untrainable row's length: longer than the positions of any model this code trains."""
EPOCH = 1_700_000_000.0
"""Envelope time of generated events: fixed, so that a seed gives the same bytes every time."""
ROLLOUT_EVENTS: tuple[type[Event], ...] = (PromptIssued, TrajectoryStarted, TrajectoryTurn, TrajectoryTool,
                                           TrajectorySegment, TrajectoryFinished)
"""Events of a rollout's own episode; the others report what became of rollouts, batches and entries."""


@dataclass(frozen=True)
class Poison:
    """One entry to write on one stream."""

    stream: StreamName
    kind: str
    fields: dict[str, bytes]
    note: str
    """What the entry is, in words."""
    must_dead_letter: bool
    """Every consumer group reading the stream must dead-letter it (with its error)."""
    rollout_id: str | None = None
    """The rollout a forged or valid-looking entry claims to belong to."""
    batch_rows: tuple[BatchRow, ...] = ()
    """A batch file to write under the run's storage before the entry (a forged batch)."""
    needs_real_batch: bool = False
    """The entry re-announces a real batch of the run: filled in when it is injected."""

    @property
    def size(self) -> int:
        return sum(len(k) + len(v) for k, v in self.fields.items())



class _Generator:
    """Deterministic per seed: one random.Random drives every choice and every random byte."""

    def __init__(self, seed: int, run_id: str, storage_uri: str, oversized_bytes: int,
                 huge_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.run_id = run_id
        self.storage = Storage(storage_uri)
        self.oversized_bytes = oversized_bytes
        self.huge_tokens = huge_tokens
        self.counter = 0

    def next_id(self, what: str) -> str:
        self.counter += 1
        return f"poison{self.seed}-{what}{self.counter:05d}"

    # -- valid events, of rollouts and groups nobody admitted
    def event(self, cls: type[Event]) -> Event:
        rng = self.rng
        # drawn whatever the type, so that a seed gives the same entries from one version of this code to
        # the next
        tokens = [rng.randrange(1, 32) for _ in range(rng.randint(4, 12))]
        sampled = rng.randint(1, len(tokens) - 1)
        logprobs = [0.0] * (len(tokens) - sampled) + [-round(rng.uniform(0.1, 3.0), 3)
                                                      for _ in range(sampled)]
        if cls in ROLLOUT_EVENTS:
            return self._rollout_event(cls, tokens, sampled, logprobs)
        return self._outcome_event(cls)

    def _rollout_event(self, cls: type[Event], tokens: list[int], sampled: int,
                       logprobs: list[float]) -> Event:
        """An event of a rollout's episode whose sample is `tokens`, the last `sampled` of them sampled."""
        rng = self.rng
        if cls is PromptIssued:
            a, b = rng.randrange(100), rng.randrange(100)
            return PromptIssued(sample_index=rng.randrange(10_000), group_size=1, policy_version=0,
                                label=str(a + b),
                                messages=[{"role": "user", "content": f"What is {a} + {b}?"}])
        if cls is TrajectoryStarted:
            return TrajectoryStarted(sample_index=rng.randrange(10_000), server_url="http://127.0.0.1:9")
        if cls is TrajectoryTurn:
            return TrajectoryTurn(turn=0, offset=len(tokens) - sampled, appended_ids=tokens[:-sampled],
                                  response_ids=tokens[-sampled:], logprobs=logprobs[-sampled:],
                                  policy_version=0, policy_version_end=0, finish_reason="stop",
                                  server_url="http://127.0.0.1:9")
        if cls is TrajectoryTool:
            return TrajectoryTool(turn=0, call_id="call_0", name="calculator",
                                  arguments={"expression": "1+1"}, ok=True, content="2")
        if cls is TrajectorySegment:
            mask = [0] * (len(tokens) - sampled) + [1] * sampled
            return TrajectorySegment(segment_index=0, attempt="forged", tokens=tokens,
                                     response_length=sampled, loss_mask=mask, rollout_logprobs=logprobs,
                                     turn_policy_versions=[0], status="completed", response_text="2",
                                     sample_index=rng.randrange(10_000), group_size=1)
        if cls is TrajectoryFinished:
            return TrajectoryFinished(status="completed", attempt="forged", segment_count=1, group_size=1,
                                      sample_index=rng.randrange(10_000), response_text="2", label="2")
        raise ValueError(f"{cls.__name__} is no event of a rollout's episode")

    def _outcome_event(self, cls: type[Event]) -> Event:
        """A grade, reward, drop, batch, policy version or dead letter, of rollouts and groups nobody
        admitted."""
        rng = self.rng
        if cls is GradeReported:
            log_uri = self.storage.path(self.run_id, "sandbox-logs", self.next_id("log") + ".log")
            return GradeReported(score=1.0, passed=True, reason="exit 0", duration_s=0.5, log_uri=log_uri)
        if cls is GradingFailed:
            return GradingFailed(reason="forged", attempts=1)
        if cls is RewardAssigned:
            return RewardAssigned(reward=1.0, advantage=1.0, source="exact_match")
        if cls is RolloutDropped:
            return RolloutDropped(reason="forged", cause="filtered")
        if cls is BatchReady:
            batch_id = self.next_id("b-")
            return BatchReady(batch_id=batch_id, uri=self.batch_uri(batch_id), sample_count=1,
                              group_ids=[self.next_id("g")], min_policy_version=0, mean_reward=1.0)
        if cls is PolicyUpdated:
            return PolicyUpdated(version=1, batch_id=self.next_id("b-"), servers=[], parity_max_abs_diff=0.0,
                                 loss=0.0, trained_samples=1,
                                 checkpoint_uri=self.storage.path(self.run_id, "checkpoints",
                                                                  self.next_id("v")))
        if cls is DeadLettered:
            stream, group = FORGED_DEAD_LETTER_OF
            return DeadLettered(stream=stream, entry_id=f"{rng.randrange(1, 10**9)}-0", group=group,
                                deliveries=1, error="forged", fields={"type": "PromptIssued"})
        raise ValueError(f"no sample event for {cls.__name__}")

    def batch_uri(self, batch_id: str) -> str:
        """Where the reward service would write the batch file of `batch_id`."""
        return self.storage.path(self.run_id, "batches", f"{batch_id}.parquet")

    def envelope(self, payload: Event, rollout_id: str | None = None,
                 group_id: str | None = None) -> Envelope:
        rollout_id = rollout_id or self.next_id("r")
        return Envelope(type=payload.TYPE, schema_version=payload.VERSION, event_id=self.next_id("e"),
                        run_id=self.run_id, time=EPOCH + self.counter, trajectory_id=rollout_id,
                        rollout_id=rollout_id, group_id=group_id or self.next_id("g"), session_id=rollout_id,
                        payload=payload)

    def fields_of(self, payload: Event, **ids: str | None) -> dict[str, bytes]:
        return as_entry_fields(encode(self.envelope(payload, **ids)))

    def stream_event(self, stream: StreamName) -> Event:
        return self.event(self.rng.choice(STREAM_EVENTS[stream]))

    # -- kinds
    def make(self, stream: StreamName, kind: str) -> list[Poison]:
        """One poison of `kind` for `stream`: one entry, or two for a forged rollout (segment, finished)."""
        made = getattr(self, f"_{kind}")(stream)
        return made if isinstance(made, list) else [made]

    def _undecodable(self, stream: StreamName, kind: str, note: str,
                     attempt: Callable[[], dict[str, bytes]]) -> Poison:
        for _ in range(100):
            fields = attempt()
            try:
                decode(fields)
            except EventDecodeError:
                return Poison(stream, kind, fields, note, must_dead_letter=True)
        raise AssertionError(f"{kind} on {stream}: 100 attempts all decoded")

    def _random_bytes(self, stream: StreamName) -> Poison:
        rng = self.rng

        def attempt() -> dict[str, bytes]:
            if rng.random() < 0.5:
                return {rng.randbytes(rng.randint(1, 12)).hex(): rng.randbytes(rng.randint(0, 256))
                        for _ in range(rng.randint(1, 4))}
            cls = rng.choice(STREAM_EVENTS[stream])
            return {"type": cls.TYPE.encode(), "v": str(cls.VERSION).encode(),
                    "body": rng.randbytes(rng.randint(0, 512))}

        return self._undecodable(stream, "random_bytes", "random fields or a random body", attempt)

    def _truncated(self, stream: StreamName) -> Poison:
        def attempt() -> dict[str, bytes]:
            fields = self.fields_of(self.stream_event(stream))
            return {**fields, "body": fields["body"][:self.rng.randrange(0, len(fields["body"]))]}

        return self._undecodable(stream, "truncated", "a valid event's body cut short", attempt)

    def _mutated(self, stream: StreamName) -> Poison:
        fields = self.fields_of(self.stream_event(stream))
        body = bytearray(fields["body"])

        def attempt() -> dict[str, bytes]:
            for _ in range(self.rng.randint(1, 8)):
                body[self.rng.randrange(len(body))] = self.rng.getrandbits(8)
            return {**fields, "body": bytes(body)}

        return self._undecodable(stream, "mutated", "a valid event's body with bytes flipped", attempt)

    def _malformed(self, stream: StreamName) -> Poison:
        rng = self.rng

        def attempt() -> dict[str, bytes]:
            fields = self.fields_of(self.stream_event(stream))
            body = msgspec.msgpack.decode(fields["body"])
            variant = rng.randrange(7)
            if variant == 0:
                return {"v": fields["v"], "body": fields["body"]}
            if variant == 1:
                return {"type": fields["type"], "v": fields["v"]}
            if variant == 2:
                return {**fields, "body": msgspec.msgpack.encode(list(body.values()))}
            if variant == 3:
                return {**fields, "body": msgspec.msgpack.encode("a string, not a map")}
            if variant == 4:
                return {**fields, "body": msgspec.msgpack.encode({i: v for i, v in enumerate(body.values())})}
            if variant == 5:
                body.pop("payload")
                return {**fields, "body": msgspec.msgpack.encode(body)}
            return {**fields, "type": b"\xff\xfe" + fields["type"]}

        return self._undecodable(stream, "malformed", "no type, no body, or a body of the wrong shape",
                                 attempt)

    def _unknown_version(self, stream: StreamName) -> Poison:
        rng = self.rng

        def attempt() -> dict[str, bytes]:
            fields = self.fields_of(self.stream_event(stream))
            if rng.random() < 0.7:
                return {**fields, "v": rng.choice([b"2", b"99", b"0", b"", b"1.0", b"-1"])}
            return {**fields, "type": fields["type"] + b"V2"}

        return self._undecodable(stream, "unknown_version", "an unknown schema version or type", attempt)

    def _wrong_types(self, stream: StreamName) -> Poison:
        rng = self.rng

        def attempt() -> dict[str, bytes]:
            fields = self.fields_of(self.stream_event(stream))
            body = msgspec.msgpack.decode(fields["body"])
            payload = body["payload"]
            name = rng.choice(sorted(payload))
            payload[name] = [1, "two"] if isinstance(payload[name], dict) else {"not": "this type"}
            return {**fields, "body": msgspec.msgpack.encode(body)}

        return self._undecodable(stream, "wrong_types", "one payload field of the wrong type", attempt)

    def _invalid_payload(self, stream: StreamName) -> Poison:
        rng = self.rng
        breaking = {
            "sample_index": -1, "group_size": 0, "segment_count": 0, "sample_count": 0, "version": -5,
            "policy_version": -1, "turn": -1, "offset": -3, "score": math.nan, "reward": math.inf,
            "advantage": -math.inf, "mean_reward": math.nan, "duration_s": math.inf, "status": "exploded",
            "response_length": 1 << 20, "loss_mask": b"\x01", "logprobs": b"\x00\x00\x80",
            "turn_policy_versions": [-1], "min_policy_version": -1, "cause": "boredom",
        }

        def attempt() -> dict[str, bytes]:
            fields = self.fields_of(self.stream_event(stream))
            body = msgspec.msgpack.decode(fields["body"])
            payload = body["payload"]
            choices = [name for name in payload if name in breaking] + ["<unknown field>", "<missing field>"]
            name = rng.choice(choices)
            if name == "<unknown field>":
                payload["surprise"] = 1
            elif name == "<missing field>":
                payload.pop(rng.choice(sorted(payload)))
            else:
                payload[name] = breaking[name]
            return {**fields, "body": msgspec.msgpack.encode(body)}

        return self._undecodable(stream, "invalid_payload", "a payload that breaks the contract", attempt)

    def _oversized(self, stream: StreamName) -> Poison:
        cls = self.rng.choice(STREAM_EVENTS[stream])

        def attempt() -> dict[str, bytes]:
            return {"type": cls.TYPE.encode(), "v": str(cls.VERSION).encode(),
                    "body": self.rng.randbytes(self.oversized_bytes)}

        return self._undecodable(stream, "oversized", f"a random body of {self.oversized_bytes} bytes",
                                 attempt)

    def _huge_tokens(self, stream: StreamName) -> Poison:
        if stream == "prompts":
            # Valid on the wire; its episode's segment would hold more tokens than the contract allows.
            words = ("alpha", "beta", "seven", "plus", "minus", "42", "what", "is")
            text = " ".join(self.rng.choice(words) for _ in range(self.oversized_bytes // 5))
            messages = [{"role": "user", "content": text}]
            prompt = self.event(PromptIssued).model_copy(update={"messages": messages})
            return Poison(stream, "huge_tokens", self.fields_of(prompt),
                          f"a prompt of {len(text)} characters", must_dead_letter=True)
        # A segment of huge_tokens tokens, packed by hand: the contract's own types refuse to build one.
        n = self.huge_tokens
        segment = self.event(TrajectorySegment)
        fields = self.fields_of(segment)
        body = msgspec.msgpack.decode(fields["body"])
        body["payload"].update(tokens=(np.arange(n, dtype="<i4") % 31 + 1).tobytes(), loss_mask=bytes(n),
                               rollout_logprobs=np.zeros(n, dtype="<f4").tobytes(), response_length=0)
        fields = {**fields, "body": msgspec.msgpack.encode(body)}
        must = True
        try:
            decode(fields)
        except EventDecodeError:
            pass
        else:  # a huge_tokens within the contract's bound: a valid, forged rollout's segment
            must = False
        return Poison(stream, "huge_tokens", fields, f"a segment of {n} tokens", must_dead_letter=must)

    def _foreign_event(self, stream: StreamName) -> Poison:
        others = [cls for other, types in STREAM_EVENTS.items() if other != stream for cls in types]
        payload = self.event(self.rng.choice(others))
        if isinstance(payload, (TrajectoryFinished, TrajectorySegment)):
            # A group of two never completes here: the reward service records these whatever stream they
            # arrive on, and a group of one would be sealed and hold back every later group (orphan_finish).
            payload = payload.model_copy(update={"group_size": 2})
        return Poison(stream, "foreign_event", self.fields_of(payload),
                      f"a {payload.TYPE}, which belongs elsewhere", must_dead_letter=True)

    def _unknown_agent(self, stream: StreamName) -> Poison:
        prompt = self.event(PromptIssued).model_copy(update={"agent": "rollstream_no_such_module:agent"})
        return Poison(stream, "unknown_agent", self.fields_of(prompt),
                      "a prompt naming an agent that does not exist", must_dead_letter=True)

    def _missing_file(self, stream: StreamName) -> Poison:
        missing = self.storage.path(self.run_id, "poison-missing", self.next_id("file"))
        if stream == "prompts":
            prompt = self.event(PromptIssued).model_copy(update={"tools": ["read_file"],
                                                                 "metadata": {"repo": missing}})
            return Poison(stream, "missing_file", self.fields_of(prompt),
                          "a coding prompt whose repository does not exist", must_dead_letter=True)
        if stream == "trajectories":
            rollout, group = self.next_id("r"), self.next_id("g")
            segment = self.event(TrajectorySegment)
            finished = self.event(TrajectoryFinished).model_copy(update={
                "artifacts": {"diff": missing + ".diff"},
                "grader": {"kind": "swebench", "dataset": missing + ".jsonl",
                           "instance_id": "no-such-instance"}})
            # Not dead-lettered: the grader owes it a verdict (GradingFailed), so that its group completes.
            return [Poison(stream, "missing_file", self.fields_of(event, rollout_id=rollout, group_id=group),
                           f"a {event.TYPE} of a rollout whose diff artifact does not exist",
                           must_dead_letter=False, rollout_id=rollout) for event in (segment, finished)]
        if stream == "batches":
            batch = self.event(BatchReady)
            return Poison(stream, "missing_file", self.fields_of(batch), "a batch whose file does not exist",
                          must_dead_letter=True)
        if stream == "policy":
            update = self.event(PolicyUpdated)
            return Poison(stream, "missing_file", self.fields_of(update),
                          "a policy version whose checkpoint does not exist", must_dead_letter=False)
        raise ValueError(f"no missing_file poison for {stream}")

    def _orphan_finish(self, stream: StreamName) -> Poison:
        rollout = self.next_id("r")
        return Poison(stream, "orphan_finish",
                      self.fields_of(self.event(TrajectoryFinished), rollout_id=rollout),
                      "a finished rollout whose segment never comes", must_dead_letter=False,
                      rollout_id=rollout)

    def _untrainable_rows(self, stream: StreamName) -> Poison:
        rollout, group, batch_id = self.next_id("r"), self.next_id("g"), self.next_id("b-")
        good = self.event(TrajectorySegment)
        base = dict(trajectory_id=rollout, group_id=group, session_id=rollout, segment_index=0,
                    response_length=good.response_length, loss_mask=good.loss_mask,
                    rollout_logprobs=good.rollout_logprobs, turn_policy_versions=[0], status="completed",
                    reward=1.0, advantage=1.0, tokens=good.tokens)
        n = LONG_ROW_TOKENS
        untrainable = (
            {"tokens": [1 << 30] * len(good.tokens)},
            {"tokens": [1] * n, "loss_mask": [1] * n, "rollout_logprobs": [-1.0] * n, "response_length": n},
            {"advantage": math.nan},
            {"turn_policy_versions": [FORGED_VERSION]},
        )
        rows = tuple(BatchRow(**{**base, "sample_index": index, "rollout_id": f"{rollout}-{index}", **broken})
                     for index, broken in enumerate(untrainable))
        batch = BatchReady(batch_id=batch_id, uri=self.batch_uri(batch_id), sample_count=len(rows),
                           group_ids=[group], min_policy_version=0, mean_reward=1.0)
        return Poison(stream, "untrainable_rows", self.fields_of(batch, group_id=group),
                      "a batch of rows no model can train on", must_dead_letter=False, rollout_id=rollout,
                      batch_rows=rows)

    def _replayed_batch(self, stream: StreamName) -> Poison:
        return Poison(stream, "replayed_batch", {}, "a real batch file announced under another batch id",
                      must_dead_letter=True, needs_real_batch=True)

    def _forged(self, stream: StreamName) -> list[Poison] | Poison:
        rollout, group = self.next_id("r"), self.next_id("g")
        if stream == "prompts":
            return Poison(stream, "forged",
                          self.fields_of(self.event(PromptIssued), rollout_id=rollout, group_id=group),
                          "a prompt the dispatcher never admitted", must_dead_letter=False,
                          rollout_id=rollout)
        if stream == "trajectories":
            segment, finished = self.event(TrajectorySegment), self.event(TrajectoryFinished)
            return [Poison(stream, "forged", self.fields_of(event, rollout_id=rollout, group_id=group),
                           f"a {event.TYPE} of a rollout nobody admitted", must_dead_letter=False,
                           rollout_id=rollout)
                    for event in (segment, finished)]
        if stream == "batches":
            return self._forged_batch(stream, rollout, group)
        if stream == "policy":
            update = self.event(PolicyUpdated).model_copy(update={"version": FORGED_VERSION})
            return Poison(stream, "forged", self.fields_of(update),
                          f"policy version {FORGED_VERSION}, never trained", must_dead_letter=False)
        if stream == "dead":
            letter = self.event(DeadLettered)
            return Poison(stream, "forged", as_entry_fields(encode(msgspec.structs.replace(
                self.envelope(letter), rollout_id=None, group_id=None, trajectory_id=None, session_id=None))),
                "a dead letter of an entry that never was", must_dead_letter=False)
        event = self.stream_event(stream)
        return Poison(stream, "forged", self.fields_of(event, rollout_id=rollout, group_id=group),
                      f"a {event.TYPE} of a rollout nobody admitted", must_dead_letter=False,
                      rollout_id=rollout)

    def _forged_batch(self, stream: StreamName, rollout: str, group: str) -> Poison:
        """A batch file of two rollouts nobody admitted (`rollout`-0 and -1, of `group`), announced."""
        batch_id = self.next_id("b-")
        rows = tuple(BatchRow(sample_index=index, trajectory_id=f"{rollout}-{index}",
                              rollout_id=f"{rollout}-{index}", group_id=group,
                              session_id=f"{rollout}-{index}", segment_index=0, tokens=segment.tokens,
                              response_length=segment.response_length, loss_mask=segment.loss_mask,
                              rollout_logprobs=segment.rollout_logprobs, turn_policy_versions=[0],
                              status="completed", reward=1.0, advantage=1.0)
                     for index, segment in enumerate(self.event(TrajectorySegment) for _ in range(2)))
        batch = BatchReady(batch_id=batch_id, uri=self.batch_uri(batch_id), sample_count=len(rows),
                           group_ids=[group], min_policy_version=0, mean_reward=1.0)
        return Poison(stream, "forged", self.fields_of(batch, rollout_id=None, group_id=group),
                      "a batch file of rollouts nobody admitted, announced", must_dead_letter=False,
                      rollout_id=rollout, batch_rows=rows)



def as_entry_fields(fields: dict) -> dict[str, bytes]:
    """encode()'s fields as a stream entry holds them: every value bytes."""
    return {key: value.encode() if isinstance(value, str) else value for key, value in fields.items()}


def poison_plan(seed: int, run_id: str, storage_uri: str, *, per_kind: int = 1,
                streams: Iterable[StreamName] = STREAMS, kinds: Iterable[str] | None = None,
                oversized_bytes: int = OVERSIZED_BYTES, huge_tokens: int = HUGE_TOKENS) -> list[Poison]:
    """`per_kind` poisons of every kind for every stream (of `kinds`, default DEFAULT_KINDS), in a
    shuffled injection order; a rollout's entries stay together, segment first. The same arguments give
    the same entries, byte for byte."""
    wanted = set(DEFAULT_KINDS if kinds is None else kinds)
    unknown = wanted - set(KINDS)
    if unknown:
        raise ValueError(f"unknown poison kinds {sorted(unknown)}; kinds are {', '.join(KINDS)}")
    generator = _Generator(seed, run_id, storage_uri, oversized_bytes, huge_tokens)
    units = [generator.make(stream, kind) for stream in streams for kind in STREAM_KINDS[stream]
             if kind in wanted for _ in range(per_kind)]
    generator.rng.shuffle(units)
    return [poison for unit in units for poison in unit]

