"""The codec (codec.py): an envelope as a stream entry's fields and back, token arrays packed on the wire, and
every way an entry can be malformed refused with an EventDecodeError that says why.

    python -m pytest tests/unit/shared/contract/test_codec.py -q
"""

import random
import re

import msgspec
import numpy as np
import pytest

from rollstream.shared.contract.events import (
    EVENT_TYPES,
    Envelope,
    EventDecodeError,
    PromptIssued,
    decode,
    encode,
    encode_event,
    make_envelope,
)
from tests.unit.shared.contract.test_events import one_of_every_event_type, segment


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


def test_encode_event_makes_the_fields_encode_makes_of_its_envelope():
    ids = dict(event_id="e1", trajectory_id="t", rollout_id="ro", group_id="g", session_id="s")
    fields = encode_event(segment(), run_id="r1", **ids)
    decoded = decode(fields)
    assert decoded == msgspec.structs.replace(make_envelope(segment(), run_id="r1", **ids), time=decoded.time)
    assert encode(decoded) == fields
    assert list(msgspec.msgpack.decode(fields["body"])) == list(Envelope.__struct_fields__)
    assert re.fullmatch(r"[0-9a-f]{32}", decode(encode_event(segment(), run_id="r1")).event_id)


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


@pytest.mark.parametrize("body", [b"\xc1garbage", msgspec.msgpack.encode([1, 2]),
                                  msgspec.msgpack.encode({"x": 1})])
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
    prompt = PromptIssued(sample_index=0, group_size=2, messages=[], policy_version=0)
    envelope = make_envelope(prompt, run_id="r")
    fields = encode(envelope)
    body = msgspec.msgpack.decode(fields["body"])
    body["payload"]["surprise"] = 1
    with pytest.raises(EventDecodeError, match="surprise"):
        decode({**fields, "body": msgspec.msgpack.encode(body)})


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


def _as_written_by_version_1(fields: dict, dropped_field: str) -> dict:
    """The entry a run recorded before `dropped_field` was added to its event (schema v1)."""
    head = msgspec.msgpack.decode(fields["body"])
    head["schema_version"] = 1
    del head["payload"][dropped_field]
    return {**fields, "v": "1", "body": msgspec.msgpack.encode(head)}


def test_an_entry_of_an_earlier_schema_version_decodes_with_the_new_fields_at_their_defaults():
    fields = encode(make_envelope(segment(role="solver"), run_id="r", rollout_id="ro"))
    old = _as_written_by_version_1(fields, "role")
    decoded = decode(old)
    assert decoded.payload.role is None and decoded.payload.tokens == [5, 6, 7, 8]
    # it is the current version's event now: written again (a replay), it reads back as one
    assert decoded.schema_version == type(decoded.payload).VERSION == 2
    assert decode(encode(decoded)) == decoded


def test_a_schema_version_before_the_first_one_read_is_rejected():
    fields = encode(make_envelope(segment(), run_id="r"))
    with pytest.raises(EventDecodeError,
                       match=r"schema version '0' is not supported \(this code reads v1 to v2\)"):
        decode({**fields, "v": "0"})
