import random

import msgspec
import pytest

from rollstream.shared.contract.events import (
    EVENT_TYPES,
    EventDecodeError,
    PromptIssued,
    TrajectorySegment,
    decode,
    encode,
    make_envelope,
)


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
    assert '"tokens":[5,6,7,8]' in envelope.model_dump_json()
