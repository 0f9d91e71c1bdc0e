import ast
import json
import pickle
import random
import re

import msgspec
import numpy as np
import pytest
from pydantic import BaseModel, ValidationError

from rollstream.shared.contract import events
from rollstream.shared.contract.consumers import groups_reading
from rollstream.shared.contract.events import (
    EVENT_TYPES,
    STREAM_EVENTS,
    Envelope,
    EventDecodeError,
    PromptIssued,
    TrajectorySegment,
    decode,
    encode,
    encode_event,
    make_envelope,
)
from tests.support import REPO

EVENTS_SOURCE = (REPO / "shared" / "contract" / "events.py").read_text()


def segment(**overrides):
    fields = dict(segment_index=0, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[0, 0, 1, 1],
                  rollout_logprobs=[0.0, 0.0, -0.5, -1.25], turn_policy_versions=[3], status="completed",
                  response_text="42", sample_index=9, group_size=4)
    return TrajectorySegment(**{**fields, **overrides})


def test_round_trip_keeps_every_field_and_the_ids():
    envelope = make_envelope(segment(), run_id="r1", rollout_id="ro", group_id="g", trajectory_id="t",
                             session_id="s", event_id="e1")
    decoded = decode(encode(envelope))
    assert decoded == envelope
    assert decoded.payload.tokens == [5, 6, 7, 8]
    assert decoded.payload.rollout_logprobs == [0.0, 0.0, -0.5, -1.25]


def test_token_arrays_are_packed_bytes_on_the_wire():
    tokens = list(range(1000))
    fields = encode(make_envelope(segment(tokens=tokens, loss_mask=[1] * 1000, rollout_logprobs=[-1.0] * 1000,
                                          response_length=1000), run_id="r"))
    body = msgspec.msgpack.decode(fields["body"])
    assert body["payload"]["tokens"] == bytes(memoryview(__import__("numpy").arange(1000, dtype="<i4")))
    assert len(fields["body"]) < 1000 * 4 + 1000 * 4 + 1000 + 500


@pytest.mark.parametrize("field, dtype, values", [
    ("tokens", "<i4", [0, 1, -1, 2**31 - 1, -(2**31), 151_000]),
    ("loss_mask", "<i1", [0, 1, 127, -128]),
    ("rollout_logprobs", "<f4", [0.0, -0.1, -1e-8, -3.4e38, float("-inf"), -1e39]),
])
def test_token_arrays_pack_to_the_bytes_numpy_packed_them_to(field, dtype, values):
    """Streams recorded before the arrays were packed with struct hold numpy's bytes: both must agree, a float
    beyond float32's range included (numpy rounds it to infinity)."""
    n = len(values)
    arrays = dict(tokens=[0] * n, loss_mask=[0] * n, rollout_logprobs=[0.0] * n, response_length=n)
    with np.errstate(over="ignore"):
        fields = encode(make_envelope(segment(**{**arrays, field: values}), run_id="r"))
        packed = msgspec.msgpack.decode(fields["body"])["payload"][field]
        assert packed == np.asarray(values, dtype=dtype).tobytes()


def test_token_arrays_given_as_lists_are_validated_as_lists():
    with pytest.raises(ValidationError, match="tokens"):
        segment(tokens=[5, 6, "seven", 8])


def test_encode_event_makes_the_fields_encode_makes_of_its_envelope():
    ids = dict(event_id="e1", trajectory_id="t", rollout_id="ro", group_id="g", session_id="s")
    fields = encode_event(segment(), run_id="r1", **ids)
    decoded = decode(fields)
    assert decoded == msgspec.structs.replace(make_envelope(segment(), run_id="r1", **ids), time=decoded.time)
    assert encode(decoded) == fields
    assert list(msgspec.msgpack.decode(fields["body"])) == list(Envelope.__struct_fields__)
    assert re.fullmatch(r"[0-9a-f]{32}", decode(encode_event(segment(), run_id="r1")).event_id)


@pytest.mark.parametrize("make", [encode_event, make_envelope])
@pytest.mark.parametrize("bad", [{"rollout_id": 7}, {"event_id": b"e1"}, {"run_id": None}, {"payload": {}}])
def test_ids_and_payloads_no_envelope_holds_are_refused(make, bad):
    arguments = {"payload": segment(), "run_id": "r1", **bad}
    with pytest.raises(TypeError, match=f"{next(iter(bad))} must be"):
        make(arguments.pop("payload"), **arguments)


def test_encode_event_names_an_id_of_a_str_subclass_which_msgpack_cannot_encode():
    class Name(str):
        pass

    with pytest.raises(TypeError, match="rollout_id must be a str or None, not Name"):
        encode_event(segment(), run_id="r1", rollout_id=Name("ro"))


def test_a_decoded_envelope_can_be_pickled():
    decoded = decode(encode(make_envelope(segment(), run_id="r1")))
    assert isinstance(decoded, Envelope) and pickle.loads(pickle.dumps(decoded)) == decoded


def test_stream_fields_may_arrive_as_bytes():
    fields = encode(make_envelope(segment(), run_id="r"))
    as_bytes = {k.encode(): v.encode() if isinstance(v, str) else v for k, v in fields.items()}
    assert decode(as_bytes).payload == segment()


def test_unknown_type_is_rejected_by_name():
    fields = encode(make_envelope(segment(), run_id="r"))
    with pytest.raises(EventDecodeError, match="unknown event type 'Nope'"):
        decode({**fields, "type": "Nope"})


def test_unknown_schema_version_is_rejected():
    fields = encode(make_envelope(segment(), run_id="r"))
    with pytest.raises(EventDecodeError, match="schema version '7' is not supported"):
        decode({**fields, "v": "7"})


@pytest.mark.parametrize("body", [b"\xc1garbage", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"x": 1})])
def test_malformed_body_is_rejected(body):
    with pytest.raises(EventDecodeError):
        decode({"type": "TrajectorySegment", "v": "1", "body": body})


def test_a_string_of_bad_utf8_in_the_body_is_a_decode_error_not_a_crash():
    body = b"\x81\xa3key\xa2\xff\xfe"  # {"key": <a msgpack string that is not UTF-8>}
    with pytest.raises(EventDecodeError, match="BatchReady body is not msgpack"):
        decode({"type": "BatchReady", "v": "1", "body": body})


def test_whatever_bytes_a_body_holds_decoding_fails_only_with_event_decode_error():
    """Random bodies and valid bodies with bytes flipped, cut or appended, for every event type: one
    malformed entry must be that entry's failure (dead-lettered), never an exception that stops a reader."""
    rng = random.Random(0)
    valid = encode(make_envelope(segment(), run_id="r1", rollout_id="ro"))["body"]
    outcomes = {"decoded": 0, "rejected": 0}
    for trial in range(4000):
        if trial % 2:
            body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
        else:
            body = bytearray(valid)
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.getrandbits(8)
            body = bytes(body[:rng.randint(1, len(body))] if trial % 4 == 2 else body)
        for type_name in EVENT_TYPES:
            try:
                decode({"type": type_name, "v": str(EVENT_TYPES[type_name].VERSION), "body": body})
                outcomes["decoded"] += 1
            except EventDecodeError:
                outcomes["rejected"] += 1
    assert outcomes["rejected"] > 0.9 * 4000 * len(EVENT_TYPES)


def test_misaligned_segment_is_rejected():
    fields = encode(make_envelope(segment(), run_id="r"))
    body = msgspec.msgpack.decode(fields["body"])
    body["payload"]["loss_mask"] = b"\x00"
    with pytest.raises(EventDecodeError, match="same length"):
        decode({**fields, "body": msgspec.msgpack.encode(body)})


def test_extra_payload_fields_are_rejected():
    envelope = make_envelope(PromptIssued(sample_index=0, group_size=2, messages=[], policy_version=0), run_id="r")
    fields = encode(envelope)
    body = msgspec.msgpack.decode(fields["body"])
    body["payload"]["surprise"] = 1
    with pytest.raises(EventDecodeError, match="surprise"):
        decode({**fields, "body": msgspec.msgpack.encode(body)})


def test_every_event_type_has_a_unique_name_and_a_version():
    assert len(EVENT_TYPES) == len({cls.TYPE for cls in EVENT_TYPES.values()})
    assert all(cls.VERSION >= 1 for cls in EVENT_TYPES.values())


def test_envelope_json_shows_the_payload():
    envelope = make_envelope(segment(), run_id="r")
    assert '"tokens": [5, 6, 7, 8]' in json.dumps(envelope.to_json())


def test_a_token_array_longer_than_the_contract_allows_is_rejected_before_it_is_unpacked():
    from rollstream.shared.contract.token_arrays import MAX_SEQUENCE_TOKENS

    fields = encode(make_envelope(segment(), run_id="r"))
    body = msgspec.msgpack.decode(fields["body"])
    n = MAX_SEQUENCE_TOKENS + 1
    body["payload"].update(tokens=bytes(4 * n), loss_mask=bytes(n), rollout_logprobs=bytes(4 * n))
    with pytest.raises(EventDecodeError, match="MAX_SEQUENCE_TOKENS"):
        decode({**fields, "body": msgspec.msgpack.encode(body)})
    with pytest.raises(ValueError, match="MAX_SEQUENCE_TOKENS"):
        segment(tokens=[0] * n, loss_mask=[0] * n, rollout_logprobs=[0.0] * n)


@pytest.mark.parametrize("event_type, field, value", [
    ("TrajectorySegment", "group_size", 0),
    ("TrajectorySegment", "sample_index", -1),
    ("TrajectorySegment", "turn_policy_versions", [-2]),
    ("TrajectoryFinished", "segment_count", 0),
    ("GradeReported", "score", float("nan")),
    ("RewardAssigned", "advantage", float("inf")),
    ("BatchReady", "sample_count", 0),
])
def test_counts_indices_and_scores_out_of_their_range_are_rejected(event_type, field, value):
    from rollstream.shared.contract.events import (
        BatchReady,
        GradeReported,
        RewardAssigned,
        TrajectoryFinished,
    )

    valid = {
        "TrajectorySegment": segment(),
        "TrajectoryFinished": TrajectoryFinished(status="completed", segment_count=1, group_size=2, sample_index=0),
        "GradeReported": GradeReported(score=1.0, passed=True, reason="exit 0", duration_s=0.1),
        "RewardAssigned": RewardAssigned(reward=1.0, advantage=0.5, source="exact_match"),
        "BatchReady": BatchReady(batch_id="b", uri="/b.parquet", sample_count=1, group_ids=["g"],
                                 min_policy_version=0, mean_reward=0.5),
    }[event_type]
    fields = encode(make_envelope(valid, run_id="r"))
    assert decode(fields).payload == valid
    body = msgspec.msgpack.decode(fields["body"])
    body["payload"][field] = value
    with pytest.raises(EventDecodeError, match=field):
        decode({**fields, "body": msgspec.msgpack.encode(body)})


@pytest.mark.parametrize("when", [float("nan"), float("inf"), float("-inf")])
def test_an_envelope_whose_time_is_not_finite_is_rejected(when):
    """Readers compute with the time (the console buckets rewards by its minute): NaN or infinity would
    raise there, long after the entry was accepted."""
    envelope = make_envelope(segment(), run_id="r")
    fields = encode(envelope)
    body = msgspec.msgpack.decode(fields["body"])
    body["time"] = when
    with pytest.raises(EventDecodeError, match="time"):
        decode({**fields, "body": msgspec.msgpack.encode(body)})


def test_every_event_type_belongs_to_exactly_one_stream():
    from rollstream.shared.contract.bus import STREAMS
    from rollstream.shared.contract.events import STREAM_EVENTS

    assert set(STREAM_EVENTS) == set(STREAMS)
    placed = [cls.TYPE for types in STREAM_EVENTS.values() for cls in types]
    assert sorted(placed) == sorted(EVENT_TYPES)


def test_a_policy_update_recorded_with_the_old_stale_count_still_decodes():
    from rollstream.shared.contract.events import PolicyUpdated

    update = PolicyUpdated(version=3, checkpoint_uri="/c", batch_id="b", servers=["http://s"], parity_max_abs_diff=0.0,
                           loss=0.1, trained_samples=6, dropped={"stale": 2})
    fields = encode(make_envelope(update, run_id="r"))
    body = msgspec.msgpack.decode(fields["body"])
    body["payload"]["dropped_stale"] = 2  # what runs recorded before the field was removed carry
    assert decode({**fields, "body": msgspec.msgpack.encode(body)}).payload == update


def declared_fields(source: str) -> dict[str, dict[str, str | None]]:
    """Class name -> {each field it declares: the docstring right after it, None without one}, as the source
    says (a ClassVar is no field)."""
    out: dict[str, dict[str, str | None]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        out[node.name] = {}
        for statement, following in zip(node.body, [*node.body[1:], None]):
            if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name) \
                    or "ClassVar" in ast.unparse(statement.annotation):
                continue
            documented = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) \
                and isinstance(following.value.value, str) and following.value.value.strip()
            out[node.name][statement.target.id] = following.value.value if documented else None
    return out


def test_the_field_docstring_check_finds_an_undocumented_field():
    source = ('class Thing(BaseModel):\n    TYPE: ClassVar[str] = "Thing"\n    model_config = ConfigDict()\n'
              '    kept: int\n    """What it means."""\n    bare: str = ""\n    blank: int = 0\n    """ """\n')
    assert declared_fields(source) == {"Thing": {"kept": "What it means.", "bare": None, "blank": None}}


def test_every_field_of_every_model_of_the_contract_has_a_docstring():
    """The schema is the contract between the services, and its source is its documentation: every field says
    what it means (and its unit or convention) right where it is declared."""
    declared = declared_fields(EVENTS_SOURCE)
    models = {name: getattr(events, name) for name in declared
              if isinstance(getattr(events, name), type) and issubclass(getattr(events, name), BaseModel)}
    unseen = [f"{name}.{field}" for name, model in models.items() for field in model.model_fields
              if not any(field in declared.get(base.__name__, {}) for base in model.__mro__)]
    assert unseen == [], "fields the source read does not find declared"
    undocumented = [f"{name}.{field}" for name in models for field, doc in declared[name].items() if doc is None]
    assert undocumented == []


def test_every_event_class_names_each_consumer_group_that_reads_its_stream():
    """Who reads an event is part of what it means: its class docstring names, as `group`, every consumer group
    of its stream (consumers.py), so that a group added to a stream is added to the documentation too."""
    docs = {node.name: ast.get_docstring(node) or "" for node in ast.parse(EVENTS_SOURCE).body
            if isinstance(node, ast.ClassDef)}
    unnamed = [f"{event.__name__} ({stream}) does not name `{group}`" for stream, types in STREAM_EVENTS.items()
               for event in types for group in groups_reading(stream) if f"`{group}`" not in docs[event.__name__]]
    assert unnamed == []


def one_of_every_event_type() -> list[events.Event]:
    """An event of each type with every field set, none to its default."""
    e = events
    return [
        PromptIssued(sample_index=3, group_size=8, messages=[{"role": "user", "content": "2+2?"}], label="4",
                     reward_fn="numeric", sandbox_check="true", agent="react", tools=["calculator"],
                     policy_version=2,
                     metadata={"grader": {"kind": "harbor", "task": "fix-add"}, "time_budget_s": 60}),
        e.TrajectoryStarted(sample_index=3, server_url="http://a:8000"),
        e.TrajectoryTurn(turn=1, segment_index=1, offset=4, appended_ids=[1, 2, 3, 4], response_ids=[5, 6],
                         logprobs=[-0.25, -1.5], policy_version=2, policy_version_end=3, finish_reason="stop",
                         server_url="http://a:8000"),
        e.TrajectoryTool(turn=1, call_id="call_1_0", name="calculator", arguments={"expression": "2+2"},
                         ok=False, error_kind="raised", content="ZeroDivisionError"),
        segment(attempt="a1", metadata={"turns": 2, "tool_calls": [{"name": "calculator"}]}),
        e.TrajectoryFinished(status="truncated", attempt="a1", segment_count=2, response_text="4", reward=0.5,
                             artifacts={"diff": "r/diffs/x.diff"}, error="turn budget", sample_index=3,
                             group_size=8, label="4", reward_fn="numeric", sandbox_check="true",
                             grader={"kind": "swebench", "instance_id": "x-1"}),
        e.GradeReported(score=0.5, passed=False, reason="1 of 2 tests", duration_s=1.5, log_uri="r/l.log",
                        tests={"test_a": "passed", "test_b": "failed"}),
        e.GradingFailed(reason="cannot be graded: no docker", attempts=2),
        e.RewardAssigned(reward=1.0, advantage=-0.5, source="sandbox"),
        e.RolloutDropped(reason="grade did not come in 60 s", cause="grade_timeout"),
        e.BatchReady(batch_id="b-1", uri="r/batches/b-1.parquet", sample_count=2, group_ids=["g1", "g2"],
                     min_policy_version=1, mean_reward=0.25),
        e.PolicyUpdated(version=3, checkpoint_uri="r/checkpoints/v3", batch_id="b-1", servers=["http://a:8000"],
                        parity_max_abs_diff=0.01, loss=0.5, trained_samples=15, dropped={"stale": 1},
                        metrics={"train/loss": 0.5}),
        e.DeadLettered(stream="prompts", entry_id="1-0", group="agent-runner", deliveries=6, error="boom",
                       fields={"type": "PromptIssued"}),
    ]


def test_every_event_type_is_encoded_as_its_own_serializer_gives_it():
    """encode() writes a payload's fields straight from the model: the bytes must be those of its pydantic
    serializer's output, for every type of the contract, and decode back to the same event."""
    examples = one_of_every_event_type()
    assert sorted(e.TYPE for e in examples) == sorted(EVENT_TYPES)
    for event in examples:
        fields = encode_event(event, run_id="r", event_id="e")
        body = msgspec.msgpack.decode(fields["body"])
        assert msgspec.msgpack.encode(body["payload"]) == msgspec.msgpack.encode(
            event.__pydantic_serializer__.to_python(event)), event.TYPE
        assert decode(fields).payload == event
