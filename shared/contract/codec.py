"""The codec: an envelope as the fields of a stream entry, and back.

On a Redis stream an event is three fields: `type`, `v` (schema version) and `body`, a msgpack document of
its envelope (envelope.py). Token ids and logprobs travel as packed little-endian int32 / float32 bytes inside
that document, and a model holds them so, as a read-only list-like PackedArray (token_arrays.py): decoding
never unpacks them. `python bench/bench_encoding.py` measures this against JSON lists (smaller and faster to
decode), `python bench/bench_bus.py` the bus built on it against raw redis-py.

An entry of an earlier schema version of its type (from Event.FIRST_VERSION on) decodes as the current one,
with the fields added since at their defaults, and its envelope says the current version.
Decoding rejects, with an `EventDecodeError` that says why, an unknown type, an unknown schema version, and a
payload that does not validate: besides the field types, counts and indices that cannot be negative (a group
of 0 samples, a rollout of 0 segments), scores and rewards that are not finite, and token arrays longer than
MAX_SEQUENCE_TOKENS (token_arrays.py), so that one entry cannot make a reader allocate without bound. It
checks a body with msgspec Structs generated from the event models, in C, and asks the models' own validation
only about a body that those refuse (event_structs.py). decode_on() also rejects an event its stream does not
carry (streams.py).

    python -m pytest tests/unit/shared/contract/test_codec.py -q
"""

from __future__ import annotations

from typing import Any

import msgspec

from rollstream.shared.contract.envelope import Envelope, envelope_fields
from rollstream.shared.contract.event_models import Event
from rollstream.shared.contract.event_structs import fast_decoder, validated_model
from rollstream.shared.contract.streams import EVENT_TYPES, STREAM_EVENTS, StreamName
from rollstream.shared.contract.token_arrays import packed_bytes
from rollstream.shared.errors import EventDecodeError

_encoder = msgspec.msgpack.Encoder(enc_hook=packed_bytes)
_decoder = msgspec.msgpack.Decoder()
_WIRE_VERSIONS = {cls: str(cls.VERSION) for cls in EVENT_TYPES.values()}  # each event class's `v` field


def encode(envelope: Envelope) -> dict[str, bytes | str]:
    """Stream fields for an envelope."""
    return _fields(msgspec.structs.asdict(envelope))


def encode_event(payload: Event, *, run_id: str, event_id: str | None = None,
                 trajectory_id: str | None = None, rollout_id: str | None = None,
                 group_id: str | None = None, session_id: str | None = None) -> dict[str, bytes | str]:
    """encode(make_envelope(...)) without making the Envelope, which costs a small event's publisher more
    than the rest of its encoding (Bus.publish's path), with make_envelope's checks."""
    return _fields(envelope_fields(payload, run_id, event_id, trajectory_id, rollout_id, group_id,
                                   session_id))


def _fields(head: dict[str, Any]) -> dict[str, bytes | str]:
    """Stream fields of an envelope's fields `head` (a dict this changes: its payload becomes its fields)."""
    # Every field of the contract holds what msgpack encodes as it is (str, numbers, None, lists and maps of
    # them) or a PackedArray (its bytes: packed_bytes): the payload's fields are encoded straight from the
    # model, as its own serializer would give them in Python mode, at half the cost of asking it.
    payload = head["payload"]
    head["payload"] = payload.__dict__
    return {"type": head["type"], "v": _WIRE_VERSIONS.get(type(payload)) or str(head["schema_version"]),
            "body": _encoder.encode(head)}


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


def decode_on(stream: StreamName, fields: dict) -> Envelope:
    """decode(), and EventDecodeError for an event of a type the stream does not carry (STREAM_EVENTS): its
    consumer cannot tell what it means there (a TrajectoryFinished on `grades` is no grade)."""
    envelope = decode(fields)
    if not isinstance(envelope.payload, STREAM_EVENTS[stream]):
        carried = ", ".join(cls.TYPE for cls in STREAM_EVENTS[stream])
        raise EventDecodeError(f"{envelope.type} does not belong on {stream} (it carries {carried})")
    return envelope


def _checked_decode(fields: dict) -> Envelope:
    """decode() by the checks that say what is wrong with an entry, or take what the fast path did not."""
    cls, version, raw = _event_class_and_body(fields)
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
    if envelope.type != type_name or envelope.schema_version != version:
        raise EventDecodeError(f"body says {envelope.type} v{envelope.schema_version}, fields say "
                               f"{type_name} v{version}")
    if version != cls.VERSION:  # an earlier version's entry, read as this one: it is this version's event now
        envelope = msgspec.structs.replace(envelope, schema_version=cls.VERSION)
    return envelope


def _event_class_and_body(fields: dict) -> tuple[type[Event], int, bytes]:
    """The event class an entry's `type` names, the schema version its `v` names (one the class reads:
    Event.FIRST_VERSION to VERSION), and its body; EventDecodeError saying what is wrong."""
    type_name = _text(fields, b"type")
    if type_name is None:
        raise EventDecodeError("entry has no 'type' field")
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise EventDecodeError(f"unknown event type {type_name!r}")
    version = _text(fields, b"v")
    readable = [str(v) for v in range(cls.FIRST_VERSION, cls.VERSION + 1)]
    if version not in readable:
        reads = " to v".join(dict.fromkeys((readable[0], readable[-1])))
        raise EventDecodeError(f"{type_name} schema version {version!r} is not supported "
                               f"(this code reads v{reads})")
    raw = _field(fields, b"body")
    if raw is None:
        raise EventDecodeError(f"{type_name} entry has no 'body' field")
    return cls, int(version), raw.encode() if isinstance(raw, str) else raw


def _field(fields: dict, key: bytes) -> bytes | str | None:
    # redis-py hands back bytes keys; archives and tests may hold str ones
    value = fields.get(key)
    return fields.get(key.decode()) if value is None else value


def _text(fields: dict, key: bytes) -> str | None:
    value = _field(fields, key)
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value

