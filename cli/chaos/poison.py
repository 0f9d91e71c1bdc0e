"""Poison entries for every stream of a run, injected into a live run while it trains, and an audit of
what became of them.

    rollstream chaos poison --seed 7 --rate 4 --versions 3     # a local run, fuzzed; prints the figures

`poison_plan` makes, deterministically per seed, entries of every kind below for every stream
(`STREAM_KINDS` says which kinds a stream gets); `fuzz` writes them into a started `LocalRun` at a rate
while it trains, lets the run reach its target version and handle everything, and `audit` reads back
what the run did with each entry; `run_poison` starts the local run around it (as `rollstream run`
does) and stops it after.

    random_bytes     fields of random bytes, or a known type with a random body
    truncated        a valid event's body cut short
    mutated          a valid event's body with bytes flipped, until it no longer decodes
    malformed        no type, no body, a body that is a list, a string, a map with integer keys, no
                     payload, a type that is not UTF-8
    unknown_version  a known type at a schema version this code does not read, or an unknown type
    wrong_types      a valid event with one payload field of the wrong type
    invalid_payload  a valid envelope whose payload breaks the contract: misaligned token arrays,
                     negative or zero counts, NaN scores, unknown or missing fields
    oversized        a random body of a few MB
    huge_tokens      a well-formed segment of 10^6 tokens (trajectories); a prompt of a few MB of text
                     (prompts)
    foreign_event    a valid event of a type that belongs on another stream
    unknown_agent    a prompt naming an agent loop that does not exist
    missing_file     valid events pointing at files that do not exist: a coding prompt's repository, a
                     rollout's diff artifact, a batch file, a checkpoint
    replayed_batch   a real batch file announced again under another batch id
    untrainable_rows a batch file whose rows no model can train on: token ids outside any vocabulary,
                     longer than any model's positions, a NaN advantage, a policy version from the future
    forged           valid events of prompts, rollouts, grades, rewards, batches and policy versions
                     the dispatcher, the agent-runner, the reward service or the trainer never made
    orphan_finish    (off by default: STALLING_KINDS) a finished rollout of a group of one whose
                     segment never comes: the reward service seals its group and holds back every
                     group after it until reward.grade_timeout_s

What each must come to (`Poison.must_dead_letter`): an entry that cannot be handled, on a stream read
through consumer groups, is dead-lettered once per group, with its error; a rollout whose diff
artifact is missing gets its verdict (GradingFailed) instead, so that its group is not held back; the
trainer leaves out every untrainable row and goes on; a forged entry must never become a training
sample (counted: forged rollouts in batches, and trained).
Streams that no group reads keep their poison; readers pass over it, and the recorder archives it.
Around all of it, every service stays up and healthy (no process exits: the local run's supervisor
records every exit it sees, one it restarted and one during the drain included, and every process is
checked once more at the end), the run reaches its target version, and every sample the dispatcher
admitted is in exactly one batch the trainer trained, each of its segments in one row.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import httpx
import msgspec
import numpy as np

from rollstream.cli.local_run import ProcessExit
from rollstream.shared.contract.archive import ArchiveReader, StreamHistory, archived_id, parse_id
from rollstream.shared.contract.batches import BatchRow, read_batch, write_batch
from rollstream.shared.contract.bus import STREAMS, Bus, StreamName
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
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.storage import Storage

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
"""Kinds that stall valid traffic as the services are (see the module docstring): asked for by name only."""
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
HEALTH_EVERY_S = 2.0


class PoisonError(RollstreamError, RuntimeError):
    """The fuzzing session could not be carried out (the run did not get where it had to)."""


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


# ------------------------------------------------------------------------------------- generation
class _Generator:
    """Deterministic per seed: one random.Random drives every choice and every random byte."""

    def __init__(self, seed: int, run_id: str, storage_uri: str, oversized_bytes: int, huge_tokens: int) -> None:
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
        tokens = [rng.randrange(1, 32) for _ in range(rng.randint(4, 12))]
        sampled = rng.randint(1, len(tokens) - 1)
        mask = [0] * (len(tokens) - sampled) + [1] * sampled
        logprobs = [0.0] * (len(tokens) - sampled) + [-round(rng.uniform(0.1, 3.0), 3) for _ in range(sampled)]
        if cls is PromptIssued:
            a, b = rng.randrange(100), rng.randrange(100)
            return PromptIssued(sample_index=rng.randrange(10_000), group_size=1, policy_version=0, label=str(a + b),
                                messages=[{"role": "user", "content": f"What is {a} + {b}?"}])
        if cls is TrajectoryStarted:
            return TrajectoryStarted(sample_index=rng.randrange(10_000), server_url="http://127.0.0.1:9")
        if cls is TrajectoryTurn:
            return TrajectoryTurn(turn=0, offset=len(tokens) - sampled, appended_ids=tokens[:-sampled],
                                  response_ids=tokens[-sampled:], logprobs=logprobs[-sampled:], policy_version=0,
                                  policy_version_end=0, finish_reason="stop", server_url="http://127.0.0.1:9")
        if cls is TrajectoryTool:
            return TrajectoryTool(turn=0, call_id="call_0", name="calculator", arguments={"expression": "1+1"},
                                  ok=True, content="2")
        if cls is TrajectorySegment:
            return TrajectorySegment(segment_index=0, attempt="forged", tokens=tokens, response_length=sampled,
                                     loss_mask=mask, rollout_logprobs=logprobs, turn_policy_versions=[0],
                                     status="completed", response_text="2", sample_index=rng.randrange(10_000),
                                     group_size=1)
        if cls is TrajectoryFinished:
            return TrajectoryFinished(status="completed", attempt="forged", segment_count=1, group_size=1,
                                      sample_index=rng.randrange(10_000), response_text="2", label="2")
        if cls is GradeReported:
            return GradeReported(score=1.0, passed=True, reason="exit 0", duration_s=0.5,
                                 log_uri=self.storage.path(self.run_id, "sandbox-logs", self.next_id("log") + ".log"))
        if cls is GradingFailed:
            return GradingFailed(reason="forged", attempts=1)
        if cls is RewardAssigned:
            return RewardAssigned(reward=1.0, advantage=1.0, source="exact_match")
        if cls is RolloutDropped:
            return RolloutDropped(reason="forged", cause="filtered")
        if cls is BatchReady:
            batch_id = self.next_id("b-")
            return BatchReady(batch_id=batch_id, uri=self.storage.path(self.run_id, "batches", f"{batch_id}.parquet"),
                              sample_count=1, group_ids=[self.next_id("g")], min_policy_version=0, mean_reward=1.0)
        if cls is PolicyUpdated:
            return PolicyUpdated(version=1, batch_id=self.next_id("b-"), servers=[], parity_max_abs_diff=0.0,
                                 loss=0.0, trained_samples=1,
                                 checkpoint_uri=self.storage.path(self.run_id, "checkpoints", self.next_id("v")))
        if cls is DeadLettered:
            return DeadLettered(stream="prompts", entry_id=f"{rng.randrange(1, 10**9)}-0", group="agent-runner",
                                deliveries=1, error="forged", fields={"type": "PromptIssued"})
        raise ValueError(f"no sample event for {cls.__name__}")

    def envelope(self, payload: Event, rollout_id: str | None = None, group_id: str | None = None) -> Envelope:
        rollout_id = rollout_id or self.next_id("r")
        return Envelope(type=payload.TYPE, schema_version=payload.VERSION, event_id=self.next_id("e"),
                        run_id=self.run_id, time=EPOCH + self.counter, trajectory_id=rollout_id,
                        rollout_id=rollout_id, group_id=group_id or self.next_id("g"), session_id=rollout_id,
                        payload=payload)

    def fields_of(self, payload: Event, **ids: str | None) -> dict[str, bytes]:
        return _as_bytes(encode(self.envelope(payload, **ids)))

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
            return {"type": cls.TYPE.encode(), "v": str(cls.VERSION).encode(), "body": rng.randbytes(rng.randint(0, 512))}

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

        return self._undecodable(stream, "malformed", "no type, no body, or a body of the wrong shape", attempt)

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
        return self._undecodable(stream, "oversized", f"a random body of {self.oversized_bytes} bytes", lambda: {
            "type": cls.TYPE.encode(), "v": str(cls.VERSION).encode(), "body": self.rng.randbytes(self.oversized_bytes)})

    def _huge_tokens(self, stream: StreamName) -> Poison:
        if stream == "prompts":
            # Valid on the wire; its episode's segment would hold more tokens than the contract allows.
            words = ("alpha", "beta", "seven", "plus", "minus", "42", "what", "is")
            text = " ".join(self.rng.choice(words) for _ in range(self.oversized_bytes // 5))
            prompt = self.event(PromptIssued).model_copy(update={"messages": [{"role": "user", "content": text}]})
            return Poison(stream, "huge_tokens", self.fields_of(prompt), f"a prompt of {len(text)} characters",
                          must_dead_letter=True)
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
        return Poison(stream, "foreign_event", self.fields_of(payload), f"a {payload.TYPE}, which belongs elsewhere",
                      must_dead_letter=True)

    def _unknown_agent(self, stream: StreamName) -> Poison:
        prompt = self.event(PromptIssued).model_copy(update={"agent": "rollstream_no_such_module:agent"})
        return Poison(stream, "unknown_agent", self.fields_of(prompt), "a prompt naming an agent that does not exist",
                      must_dead_letter=True)

    def _missing_file(self, stream: StreamName) -> Poison:
        missing = self.storage.path(self.run_id, "poison-missing", self.next_id("file"))
        if stream == "prompts":
            prompt = self.event(PromptIssued).model_copy(update={"tools": ["read_file"], "metadata": {"repo": missing}})
            return Poison(stream, "missing_file", self.fields_of(prompt), "a coding prompt whose repository does not exist",
                          must_dead_letter=True)
        if stream == "trajectories":
            rollout, group = self.next_id("r"), self.next_id("g")
            segment = self.event(TrajectorySegment)
            finished = self.event(TrajectoryFinished).model_copy(update={
                "artifacts": {"diff": missing + ".diff"},
                "grader": {"kind": "swebench", "dataset": missing + ".jsonl", "instance_id": "no-such-instance"}})
            # Not dead-lettered: the grader owes it a verdict (GradingFailed), so that its group completes.
            return [Poison(stream, "missing_file", self.fields_of(event, rollout_id=rollout, group_id=group),
                           f"a {event.TYPE} of a rollout whose diff artifact does not exist", must_dead_letter=False,
                           rollout_id=rollout) for event in (segment, finished)]
        if stream == "batches":
            batch = self.event(BatchReady)
            return Poison(stream, "missing_file", self.fields_of(batch), "a batch whose file does not exist",
                          must_dead_letter=True)
        if stream == "policy":
            update = self.event(PolicyUpdated)
            return Poison(stream, "missing_file", self.fields_of(update), "a policy version whose checkpoint does not exist",
                          must_dead_letter=False)
        raise ValueError(f"no missing_file poison for {stream}")

    def _orphan_finish(self, stream: StreamName) -> Poison:
        rollout = self.next_id("r")
        return Poison(stream, "orphan_finish", self.fields_of(self.event(TrajectoryFinished), rollout_id=rollout),
                      "a finished rollout whose segment never comes", must_dead_letter=False, rollout_id=rollout)

    def _untrainable_rows(self, stream: StreamName) -> Poison:
        rollout, group, batch_id = self.next_id("r"), self.next_id("g"), self.next_id("b-")
        good = self.event(TrajectorySegment)
        base = dict(trajectory_id=rollout, group_id=group, session_id=rollout, segment_index=0,
                    response_length=good.response_length, loss_mask=good.loss_mask,
                    rollout_logprobs=good.rollout_logprobs, turn_policy_versions=[0], status="completed", reward=1.0,
                    advantage=1.0, tokens=good.tokens)
        n = LONG_ROW_TOKENS
        untrainable = (
            {"tokens": [1 << 30] * len(good.tokens)},
            {"tokens": [1] * n, "loss_mask": [1] * n, "rollout_logprobs": [-1.0] * n, "response_length": n},
            {"advantage": math.nan},
            {"turn_policy_versions": [FORGED_VERSION]},
        )
        rows = tuple(BatchRow(**{**base, "sample_index": index, "rollout_id": f"{rollout}-{index}", **broken})
                     for index, broken in enumerate(untrainable))
        batch = BatchReady(batch_id=batch_id, uri=self.storage.path(self.run_id, "batches", f"{batch_id}.parquet"),
                           sample_count=len(rows), group_ids=[group], min_policy_version=0, mean_reward=1.0)
        return Poison(stream, "untrainable_rows", self.fields_of(batch, group_id=group),
                      "a batch of rows no model can train on", must_dead_letter=False, rollout_id=rollout,
                      batch_rows=rows)

    def _replayed_batch(self, stream: StreamName) -> Poison:
        return Poison(stream, "replayed_batch", {}, "a real batch file announced under another batch id",
                      must_dead_letter=True, needs_real_batch=True)

    def _forged(self, stream: StreamName) -> list[Poison] | Poison:
        rollout, group = self.next_id("r"), self.next_id("g")
        if stream == "prompts":
            return Poison(stream, "forged", self.fields_of(self.event(PromptIssued), rollout_id=rollout, group_id=group),
                          "a prompt the dispatcher never admitted", must_dead_letter=False, rollout_id=rollout)
        if stream == "trajectories":
            segment, finished = self.event(TrajectorySegment), self.event(TrajectoryFinished)
            return [Poison(stream, "forged", self.fields_of(event, rollout_id=rollout, group_id=group),
                           f"a {event.TYPE} of a rollout nobody admitted", must_dead_letter=False, rollout_id=rollout)
                    for event in (segment, finished)]
        if stream == "batches":
            batch_id = self.next_id("b-")
            rows = tuple(BatchRow(sample_index=index, trajectory_id=f"{rollout}-{index}", rollout_id=f"{rollout}-{index}",
                                  group_id=group, session_id=f"{rollout}-{index}", segment_index=0, tokens=segment.tokens,
                                  response_length=segment.response_length, loss_mask=segment.loss_mask,
                                  rollout_logprobs=segment.rollout_logprobs, turn_policy_versions=[0],
                                  status="completed", reward=1.0, advantage=1.0)
                         for index, segment in enumerate(self.event(TrajectorySegment) for _ in range(2)))
            batch = BatchReady(batch_id=batch_id, uri=self.storage.path(self.run_id, "batches", f"{batch_id}.parquet"),
                               sample_count=len(rows), group_ids=[group], min_policy_version=0, mean_reward=1.0)
            return Poison(stream, "forged", self.fields_of(batch, rollout_id=None, group_id=group),
                          "a batch file of rollouts nobody admitted, announced", must_dead_letter=False,
                          rollout_id=rollout, batch_rows=rows)
        if stream == "policy":
            update = self.event(PolicyUpdated).model_copy(update={"version": FORGED_VERSION})
            return Poison(stream, "forged", self.fields_of(update), f"policy version {FORGED_VERSION}, never trained",
                          must_dead_letter=False)
        if stream == "dead":
            letter = self.event(DeadLettered)
            return Poison(stream, "forged", _as_bytes(encode(self.envelope(letter).model_copy(update={
                "rollout_id": None, "group_id": None, "trajectory_id": None, "session_id": None}))),
                "a dead letter of an entry that never was", must_dead_letter=False)
        event = self.stream_event(stream)
        return Poison(stream, "forged", self.fields_of(event, rollout_id=rollout, group_id=group),
                      f"a {event.TYPE} of a rollout nobody admitted", must_dead_letter=False, rollout_id=rollout)


def _is_finish(fields: dict) -> bool:
    return fields.get("type") == TrajectoryFinished.TYPE.encode()


def _as_bytes(fields: dict) -> dict[str, bytes]:
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
    units = [generator.make(stream, kind) for stream in streams for kind in STREAM_KINDS[stream] if kind in wanted
             for _ in range(per_kind)]
    generator.rng.shuffle(units)
    return [poison for unit in units for poison in unit]


# -------------------------------------------------------------------------------------- injection
@dataclass
class Injected:
    poison: Poison
    entry_id: str
    fields: dict[str, bytes]
    """What was written (a replayed batch's fields are only known when it is written)."""


def real_batches(bus: Bus, injected_ids: set[tuple[str, str]]) -> list[BatchReady]:
    """The run's own BatchReady events still on the stream (not the fuzzer's)."""
    return [d.event for d in bus.read_all("batches")
            if ("batches", d.entry_id) not in injected_ids and isinstance(d.event, BatchReady)]


def write_poison(bus: Bus, storage: Storage, poison: Poison, injected_ids: set[tuple[str, str]]) -> Injected | None:
    """XADD one poison (writing its batch file first); None when it needs a real batch and there is none yet."""
    fields = poison.fields
    if poison.needs_real_batch:
        batches = real_batches(bus, injected_ids)
        if not batches:
            return None
        real = batches[-1]
        copy = real.model_copy(update={"batch_id": f"{real.batch_id}-again"})
        fields = _as_bytes(encode(Envelope(type=copy.TYPE, schema_version=copy.VERSION, event_id=f"{real.batch_id}-again",
                                           run_id=bus.keys.run_id, time=EPOCH, payload=copy)))
    if poison.batch_rows:
        batch = decode(fields).payload
        write_batch(storage, bus.keys.run_id, batch.batch_id, list(poison.batch_rows))
    entry_id = bus.redis.xadd(bus.keys.stream(poison.stream), fields)
    return Injected(poison, entry_id.decode(), fields)


# ------------------------------------------------------------------------------------------ audit
@dataclass
class StreamFigures:
    stream: StreamName
    groups: tuple[str, ...]
    """Consumer groups reading the stream at the end of the run."""
    tried: int = 0
    bytes_written: int = 0
    kinds: Counter = field(default_factory=Counter)
    must_dead_letter: int = 0
    """Entries every group must dead-letter (on a stream no group reads: none must)."""
    dead_lettered: int = 0
    """Of those, the ones every group did dead-letter, each with an error."""
    missed: list[str] = field(default_factory=list)
    """'kind entry-id: group' for each dead letter that should be there and is not."""
    dead_lettered_other: int = 0
    """Entries not required to be dead-lettered that some group dead-lettered anyway."""
    verdicts: int = 0
    """Rollouts with a missing diff artifact that got their GradingFailed."""
    forged: int = 0
    untrainable_rows: int = 0
    """Rows of the untrainable batches written."""
    rows_left_out: int = 0
    """Of those, the rows the trainer left out (PolicyUpdated.dropped["invalid"] of their batch)."""
    archived: int = 0
    """Entries found in the run's archive (the recorder's copy of the stream)."""


@dataclass
class PoisonReport:
    seed: int
    rate: float
    streams: dict[StreamName, StreamFigures]
    injected: list[Injected]
    dead_letters: dict[tuple[str, str], dict[str, str]]
    """(stream, entry id) -> {group: error} for every dead letter the services wrote."""
    health: dict[str, str]
    """Process -> 'ok', or what was wrong with it at the end (exited, /healthz status)."""
    unhealthy_moments: list[str]
    """Every time a /healthz answered anything but 200 while the run went on."""
    target_version: int
    version: int
    """The trainer's own last policy version (forged PolicyUpdated entries left out)."""
    dispatcher_version_seen: int
    """The highest policy version the dispatcher's /healthz reported while the run went on."""
    admitted: list[str]
    """Rollouts the dispatcher admitted."""
    batches_of: dict[str, set[str]]
    """Rollout -> the run's own batches holding it."""
    segment_rows: dict[str, Counter]
    """Rollout -> segment index -> rows of the run's own batches holding that segment."""
    valid_batches: list[str]
    trained_batches: list[str]
    """Batches the trainer published a policy version for, in order (with repeats, if any)."""
    forged_rollouts: set[str]
    forged_batched: set[str]
    """Forged rollouts found in a batch the reward service wrote."""
    forged_trained: set[str]
    """Forged rollouts in a batch the trainer trained on."""
    dropped: dict[str, str]
    """Admitted rollouts the reward service dropped (RolloutDropped), with the reason."""
    seconds: float = 0.0
    unexpected_exits: list[ProcessExit] = field(default_factory=list)
    """Process exits the local run's supervisor saw while it was fuzzed (no fault is injected here: any is one)."""

    @property
    def healthy(self) -> bool:
        return all(state == "ok" for state in self.health.values())

    @property
    def batched_once(self) -> int:
        return len(self.admitted) - len(self.unbatched) - len(self.batched_more_than_once)

    @property
    def unbatched(self) -> list[str]:
        return [rollout for rollout in self.admitted if not self.batches_of.get(rollout)]

    @property
    def batched_more_than_once(self) -> list[str]:
        """In several batches, or with a segment in several rows (of one batch or of several)."""
        return [rollout for rollout in self.admitted if len(self.batches_of.get(rollout, ())) > 1
                or any(n > 1 for n in self.segment_rows.get(rollout, Counter()).values())]


def consumer_groups(bus: Bus, stream: StreamName) -> tuple[str, ...]:
    try:
        groups = bus.redis.xinfo_groups(bus.keys.stream(stream))
    except Exception:  # no such stream
        return ()
    return tuple(sorted(g["name"].decode() if isinstance(g["name"], bytes) else g["name"] for g in groups))


def _history(bus: Bus, stream: StreamName, storage_uri: str) -> list[tuple[str, dict]]:
    return StreamHistory(bus, stream, ArchiveReader(storage_uri, bus.keys.run_id)).new_entries()


def _events(bus: Bus, stream: StreamName, storage_uri: str,
            skip: set[tuple[str, str]] = frozenset()) -> list[tuple[str, Envelope]]:
    """A stream's decodable events (archive, then live), but for the (stream, entry id) pairs in skip."""
    out = []
    for entry_id, fields in _history(bus, stream, storage_uri):
        if (stream, entry_id) in skip:
            continue
        try:
            out.append((entry_id, decode(fields)))
        except EventDecodeError:
            continue
    return out


def trainer_version(bus: Bus, storage_uri: str, injected_ids: set[tuple[str, str]]) -> int:
    updates = [e.payload.version for _, e in _events(bus, "policy", storage_uri, injected_ids)
               if isinstance(e.payload, PolicyUpdated)]
    return max(updates, default=0)


def audit(bus: Bus, storage_uri: str, injected: list[Injected], *, seed: int, rate: float, target_version: int,
          health: dict[str, str], unhealthy_moments: list[str], dispatcher_version_seen: int) -> PoisonReport:
    """What the run did with every injected entry, and with its own samples."""
    injected_ids = {(i.poison.stream, i.entry_id) for i in injected}
    storage = Storage(storage_uri)
    dead_letters: dict[tuple[str, str], dict[str, str]] = defaultdict(dict)
    for _, envelope in _events(bus, "dead", storage_uri, injected_ids):
        letter = envelope.payload
        if isinstance(letter, DeadLettered):
            dead_letters[(letter.stream, letter.entry_id)][letter.group] = letter.error
    verdicts = {e.rollout_id for _, e in _events(bus, "grades", storage_uri, injected_ids)
                if isinstance(e.payload, GradingFailed)}

    archive = ArchiveReader(storage_uri, bus.keys.run_id)
    archived_ids = {stream: {entry.entry_id for entry in archive.entries(stream)} for stream in archive.streams()}
    figures = {stream: StreamFigures(stream, consumer_groups(bus, stream)) for stream in STREAMS}
    forged_rollouts: set[str] = set()
    for item in injected:
        poison, figure = item.poison, figures[item.poison.stream]
        figure.tried += 1
        figure.bytes_written += sum(len(k) + len(v) for k, v in item.fields.items())
        figure.kinds[poison.kind] += 1
        figure.archived += item.entry_id in archived_ids.get(poison.stream, set())
        letters = dead_letters.get((poison.stream, item.entry_id), {})
        if poison.must_dead_letter and figure.groups:
            figure.must_dead_letter += 1
            missing = [g for g in figure.groups if not letters.get(g)]
            if missing:
                figure.missed.extend(f"{poison.kind} {item.entry_id}: {g}" for g in missing)
            else:
                figure.dead_lettered += 1
        elif letters:
            figure.dead_lettered_other += 1
        if poison.kind == "missing_file" and poison.stream == "trajectories" and _is_finish(item.fields):
            figure.verdicts += poison.rollout_id in verdicts
        if poison.kind == "forged":
            figure.forged += 1
            if poison.rollout_id:
                forged_rollouts.add(poison.rollout_id)
                forged_rollouts.update(row.rollout_id for row in poison.batch_rows)

    prompts = [e for _, e in _events(bus, "prompts", storage_uri, injected_ids) if isinstance(e.payload, PromptIssued)]
    admitted = [e.rollout_id for e in prompts]
    # the version each admission was made under: one the trainer never reached was read from a forged entry
    dispatcher_version_seen = max([dispatcher_version_seen, *(e.payload.policy_version for e in prompts)])
    batches_of: dict[str, set[str]] = defaultdict(set)
    segment_rows: dict[str, Counter] = defaultdict(Counter)
    valid_batches = []
    forged_in: dict[str, set[str]] = defaultdict(set)
    for entry_id, envelope in _events(bus, "batches", storage_uri):
        batch = envelope.payload
        if not isinstance(batch, BatchReady):
            continue
        try:
            rows = read_batch(storage, batch.uri)
        except Exception:  # the fuzzer's batches whose file is missing or is no batch
            continue
        for row in rows:
            if row.rollout_id in forged_rollouts:
                forged_in[batch.batch_id].add(row.rollout_id)
        if ("batches", entry_id) not in injected_ids:
            valid_batches.append(batch.batch_id)
            for row in rows:
                batches_of[row.rollout_id].add(batch.batch_id)
                segment_rows[row.rollout_id][row.segment_index] += 1
    updates = [e.payload for _, e in _events(bus, "policy", storage_uri, injected_ids)
               if isinstance(e.payload, PolicyUpdated)]
    trained = [update.batch_id for update in updates]
    left_out = {update.batch_id: update.dropped.get("invalid", 0) for update in updates}
    for item in injected:
        if item.poison.kind == "untrainable_rows":
            figure = figures[item.poison.stream]
            figure.untrainable_rows += len(item.poison.batch_rows)
            figure.rows_left_out += left_out.get(decode(item.fields).payload.batch_id, 0)
    forged_batched = {r for batch_id in valid_batches for r in forged_in.get(batch_id, ())}
    forged_trained = {r for batch_id in trained for r in forged_in.get(batch_id, ())}
    admitted_set = set(admitted)
    dropped = {e.rollout_id: e.payload.reason for _, e in _events(bus, "rewards", storage_uri, injected_ids)
               if isinstance(e.payload, RolloutDropped) and e.rollout_id in admitted_set}
    return PoisonReport(
        seed=seed, rate=rate, streams=figures, injected=injected, dead_letters=dict(dead_letters), health=health,
        unhealthy_moments=unhealthy_moments, target_version=target_version,
        version=trainer_version(bus, storage_uri, injected_ids), dispatcher_version_seen=dispatcher_version_seen,
        admitted=admitted, batches_of=dict(batches_of), segment_rows=dict(segment_rows), valid_batches=valid_batches, trained_batches=trained,
        forged_rollouts=forged_rollouts, forged_batched=forged_batched, forged_trained=forged_trained, dropped=dropped)


# ------------------------------------------------------------------------------------- the session
def health_states(local) -> tuple[dict[str, str], dict[str, dict]]:
    """Process -> 'ok' or what is wrong; and each /healthz body that answered."""
    states, bodies = {}, {}
    for name, process in local.processes.items():
        code = process.poll()
        if code is not None:
            states[name] = f"exited with code {code}"
            continue
        try:
            response = httpx.get(f"http://127.0.0.1:{local.health_ports[name]}/healthz", timeout=2)
        except (httpx.HTTPError, KeyError) as exc:
            states[name] = f"/healthz did not answer: {exc}"
            continue
        try:
            bodies[name] = response.json()
        except ValueError:
            bodies[name] = {}
        states[name] = "ok" if response.status_code == 200 else f"/healthz {response.status_code}: {response.text[:200]}"
    return states, bodies


def wait_archived(bus: Bus, injected: list[Injected], timeout_s: float) -> None:
    """Until the recorder's archived position of every stream is past the last entry injected there."""
    last: dict[StreamName, str] = {}
    for item in injected:
        last[item.poison.stream] = item.entry_id
    deadline = time.monotonic() + timeout_s
    while True:
        behind = [s for s, entry_id in last.items()
                  if (archived := archived_id(bus, s)) is None or parse_id(archived) < parse_id(entry_id)]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise PoisonError(f"the recorder has not archived the poison of {', '.join(behind)} after {timeout_s:.0f}s")
        time.sleep(0.5)


def fuzz(local, plan: list[Poison], *, seed: int, rate: float, target_version: int, timeout_s: float,
         drain_timeout_s: float = 300.0, on_progress: Callable[[str], None] = lambda message: None) -> PoisonReport:
    """Inject `plan` into the started LocalRun at `rate` entries a second while it trains, then wait
    until the trainer reaches `target_version`, every consumer has handled everything and the recorder
    has archived it; check every service's health all along, and audit."""
    bus, settings = local.bus, local.settings
    storage = Storage(settings.storage_uri)
    started = time.monotonic()
    deadline = started + timeout_s
    pending = list(plan)
    injected: list[Injected] = []
    injected_ids: set[tuple[str, str]] = set()
    unhealthy: list[str] = []
    dispatcher_version = 0
    next_write = next_health = time.monotonic()

    def look() -> None:
        nonlocal next_health, dispatcher_version
        if time.monotonic() < next_health:
            return
        next_health = time.monotonic() + HEALTH_EVERY_S
        states, bodies = health_states(local)
        at = f"{time.monotonic() - started:.0f}s"
        unhealthy.extend(f"{at} {name}: {state}" for name, state in states.items() if state != "ok")
        dispatcher_version = max(dispatcher_version, int(bodies.get("dispatcher", {}).get("policy_version") or 0))
        local.check_alive()

    while pending:
        if time.monotonic() > deadline:
            raise PoisonError(f"{len(pending)} poison entries not injected after {timeout_s:.0f}s")
        look()
        now = time.monotonic()
        if now < next_write:
            time.sleep(min(next_write - now, 0.2))
            continue
        next_write = now + 1.0 / rate
        for index, poison in enumerate(pending):
            item = write_poison(bus, storage, poison, injected_ids)
            if item is not None:
                injected.append(item)
                injected_ids.add((poison.stream, item.entry_id))
                del pending[index]
                break
            # a replayed batch waits for the run's first batch; meanwhile the next entry goes
    on_progress(f"{len(injected)} poison entries injected; waiting for version {target_version}")
    while (version := trainer_version(bus, settings.storage_uri, injected_ids)) < target_version:
        if time.monotonic() > deadline:
            raise PoisonError(f"policy version {version} after {timeout_s:.0f}s, wanted {target_version}")
        look()
        time.sleep(1.0)
    on_progress("target version reached; waiting until every entry is handled")
    local.wait_drained(timeout_s=drain_timeout_s)
    wait_archived(bus, injected, timeout_s=max(30.0, 3 * settings.recorder.flush_s))
    next_health = 0.0
    look()
    health, _ = health_states(local)
    report = audit(bus, settings.storage_uri, injected, seed=seed, rate=rate, target_version=target_version,
                   health=health, unhealthy_moments=unhealthy, dispatcher_version_seen=dispatcher_version)
    local.check_alive()  # an exit after the last look counts as much as one while the run went on
    report.unexpected_exits = local.unexpected_exits()
    report.seconds = time.monotonic() - started
    return report


def run_poison(settings, *, seed: int, rate: float, timeout_s: float, per_kind: int = 1,
               kinds: Iterable[str] | None = None, oversized_bytes: int = OVERSIZED_BYTES,
               huge_tokens: int = HUGE_TOKENS, fleet_urls: list[str] | None = None,
               on_progress: Callable[[str], None] = lambda message: None):
    """Start a local run with `settings`, fuzz it with the seed's plan, stop it. Returns the report
    and the services' exit codes."""
    from rollstream.cli.local_run import LocalRun

    local = LocalRun(settings, fleet_urls=fleet_urls)
    codes: dict[str, int | None] = {}
    try:
        local.start(on_step=on_progress)
        plan = poison_plan(seed, local.settings.run_id, local.settings.storage_uri, per_kind=per_kind, kinds=kinds,
                           oversized_bytes=oversized_bytes, huge_tokens=huge_tokens)
        on_progress(f"services up; injecting {len(plan)} poison entries at {rate:g}/s (logs in {local.log_dir})")
        report = fuzz(local, plan, seed=seed, rate=rate, target_version=local.settings.train.total_versions,
                      timeout_s=timeout_s, on_progress=on_progress)
    finally:
        codes = local.stop() if local.processes or local.vllm or local.redis_server else {}
    return report, codes, local


def figures_rows(report: PoisonReport) -> list[tuple[str, ...]]:
    """One row per stream: stream, consumer groups, tried, dead-lettered (must), other outcomes, archived."""
    rows = []
    for stream in STREAMS:
        f = report.streams[stream]
        dead = f"{f.dead_lettered}/{f.must_dead_letter}" if f.groups else "-"
        other = []
        if f.verdicts:
            other.append(f"{f.verdicts} GradingFailed")
        if f.untrainable_rows:
            other.append(f"{f.rows_left_out}/{f.untrainable_rows} untrainable rows left out")
        if f.forged:
            other.append(f"{f.forged} forged")
        if f.dead_lettered_other:
            other.append(f"{f.dead_lettered_other} other dead-lettered")
        rows.append((stream, ", ".join(f.groups) or "(none)", str(f.tried), f"{f.bytes_written / 1e6:.1f} MB", dead,
                     "; ".join(other) or "-", f"{f.archived}/{f.tried}"))
    return rows


def checks(report: PoisonReport) -> list[tuple[str, bool, str]]:
    """What a poisoned run must show: (check, passed, the figures behind it)."""
    streams = report.streams.values()
    must = sum(f.must_dead_letter for f in streams)
    dead = sum(f.dead_lettered for f in streams)
    missed = [m for f in streams for m in f.missed]
    verdicts, batches = report.streams["trajectories"], report.streams["batches"]
    owed = sum(i.poison.kind == "missing_file" and _is_finish(i.fields) for i in report.injected)
    archived, tried = sum(f.archived for f in streams), sum(f.tried for f in streams)
    trained = Counter(report.trained_batches)
    untrained = [b for b in report.valid_batches if not trained.get(b)]
    twice = [b for b, n in trained.items() if n > 1]
    admitted = len(report.admitted)
    return [
        ("every undeliverable entry dead-lettered by every group reading its stream, with its error",
         not missed, f"{dead}/{must}" + (f"; missing: {', '.join(missed[:6])}" + (" ..." if len(missed) > 6 else "")
                                         if missed else "")),
        ("every rollout with a missing diff artifact got its verdict (GradingFailed)",
         verdicts.verdicts == owed, f"{verdicts.verdicts}/{owed}"),
        ("every service healthy at the end (every /healthz 200, no process exited)",
         report.healthy, ", ".join(f"{name}: {state}" for name, state in sorted(report.health.items()))),
        ("no /healthz answered anything but 200 during the run", not report.unhealthy_moments,
         "; ".join(report.unhealthy_moments[:4]) or "none"),
        ("no process exited, not even one the supervisor restarted (the drain and the end included)",
         not report.unexpected_exits,
         "; ".join(f"{e.process} code {e.exit_code} at {e.at_s:.0f}s" for e in report.unexpected_exits) or "none"),
        ("the trainer left out every row no model can train on", batches.rows_left_out == batches.untrainable_rows,
         f"{batches.rows_left_out}/{batches.untrainable_rows}"),
        ("the trainer reached the target version", report.version >= report.target_version,
         f"{report.version}/{report.target_version}"),
        ("every admitted sample in exactly one batch, each of its segments in one row",
         report.batched_once == admitted,
         f"{report.batched_once}/{admitted} in one batch, {len(report.unbatched)} in none"
         + (f" ({len(report.dropped)} dropped by the reward service)" if report.dropped else "")
         + f", {len(report.batched_more_than_once)} in several"),
        ("every batch of the run trained once", not untrained and not twice,
         f"{len(report.valid_batches) - len(untrained)}/{len(report.valid_batches)} trained"
         + (f", {len(twice)} more than once" if twice else "")),
        ("no forged sample in a batch of the run, none trained", not report.forged_batched and not report.forged_trained,
         f"{len(report.forged_batched)}/{len(report.forged_rollouts)} forged rollouts batched, "
         f"{len(report.forged_trained)} trained"),
        ("the dispatcher's policy version never ahead of the trainer's", report.dispatcher_version_seen <= report.version,
         f"dispatcher saw {report.dispatcher_version_seen}, trainer at {report.version}"),
        ("the recorder archived every poison entry", archived == tried, f"{archived}/{tried}"),
    ]


def report_tables(report: PoisonReport):
    """The figures as two rich tables: per stream, then the checks."""
    from rich.table import Table
    from rich.text import Text

    per_stream = Table(title=f"poison fuzz: seed {report.seed}, {report.rate:g} entries/s, {len(report.injected)} "
                             f"entries, {report.seconds:.0f}s")
    for column in ("stream", "consumer groups", "tried", "written", "dead-lettered", "other outcomes", "archived"):
        per_stream.add_column(column, justify="left" if column in ("stream", "consumer groups", "other outcomes")
                              else "right")
    for row in figures_rows(report):
        per_stream.add_row(*row)
    per_stream.caption = ("dead-lettered: entries every consumer group of the stream dead-lettered / entries that "
                          "cannot be handled (a stream no group reads keeps them); kinds per stream: "
                          + "; ".join(f"{s}: {', '.join(f'{k} {n}' for k, n in sorted(f.kinds.items()))}"
                                      for s, f in report.streams.items() if f.kinds))
    verdict = Table(title="what the run kept")
    verdict.add_column("check")
    verdict.add_column("", justify="center")
    verdict.add_column("figures")
    for name, passed, figures in checks(report):
        verdict.add_row(name, Text("ok", style="green") if passed else Text("FAILED", style="bold red"), Text(figures))
    return per_stream, verdict
