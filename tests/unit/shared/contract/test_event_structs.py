"""decode()'s fast path (event_structs.py) must decode exactly what the models' own validation decodes, and
refuse exactly what it refuses, with the same error."""

import pickle
from typing import Annotated, Any

import msgspec
import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollstream.shared.contract import codec
from rollstream.shared.contract.event_structs import fast_decoder
from rollstream.shared.contract.events import Envelope, Event, EventDecodeError, decode, encode, encode_event
from tests.unit.shared.contract.test_events import one_of_every_event_type

ODD_VALUES = [None, -1, 0, 1, 2.5, -0.0, float("nan"), float("inf"), True, "", "7", b"\x00\x01\x02\x03",
              [], [1, "a"], [-3], {}, {"k": 1}, {1: "k"}, 2**63]
"""Values a field may be given in a body encode() did not write: a wrong type, a bound, a lax coercion."""


def pydantic_only(monkeypatch):
    monkeypatch.setattr(codec, "_FAST_DECODE_OF_WIRE", {})


def outcome(fields: dict) -> tuple[str, Any]:
    try:
        envelope = decode(fields)
    except EventDecodeError as exc:
        return "refused", str(exc)
    # Equal bytes: the same values of the same types (an int is not a float on the wire); no model equality,
    # which a NaN (in a float field with no bounds) fails for the same model
    return "decoded", (type(envelope), type(envelope.payload), encode(envelope), repr(envelope),
                       envelope.payload.__pydantic_extra__, envelope.payload.__pydantic_private__)


def bodies_with_one_field_changed():
    """Every event type's body with each of its fields, and each of the envelope's, given each odd value or
    left out; and with a field it does not have."""
    for event in one_of_every_event_type():
        fields = encode_event(event, run_id="r", event_id="e", rollout_id="ro")
        body = msgspec.msgpack.decode(fields["body"])
        for where, names in (("payload", list(body["payload"]) + ["surprise"]), ("envelope", list(body))):
            for name in names:
                for value in [*ODD_VALUES, "left out"]:
                    changed = {**body, "payload": dict(body["payload"])}
                    target = changed["payload"] if where == "payload" else changed
                    if value == "left out":
                        target.pop(name, None)
                    else:
                        target[name] = value
                    body_changed = msgspec.msgpack.encode(changed)
                    yield f"{event.TYPE} {where}.{name}={value!r}", {**fields, "body": body_changed}


def test_every_event_type_but_one_with_a_before_validator_has_a_fast_path():
    without = {cls.TYPE for cls, fast in codec._FAST_DECODE_ENVELOPE_OF.items() if fast is None}
    # Its validator drops a field that old runs recorded, before the fields are checked
    assert without == {"PolicyUpdated"}


def test_the_fast_path_decodes_every_event_type_as_its_model_validates_it(monkeypatch):
    examples = one_of_every_event_type()
    encoded = [encode_event(event, run_id="r", event_id="e", rollout_id="ro", group_id="g")
               for event in examples]
    fast = [outcome(fields) for fields in encoded]
    for event, fields in zip(examples, encoded):
        fast_decode = codec._FAST_DECODE_ENVELOPE_OF[type(event)]
        if fast_decode is not None:  # decoded by the fast path itself, not by its fallback
            assert fast_decode(fields["body"]).payload == event
    with monkeypatch.context() as patch:
        pydantic_only(patch)
        assert fast == [outcome(fields) for fields in encoded]


def test_what_the_fast_path_decodes_behaves_as_a_validated_model():
    for event in one_of_every_event_type():
        envelope = decode(encode_event(event, run_id="r", event_id="e"))
        assert pickle.loads(pickle.dumps(envelope)) == envelope
        copied = msgspec.structs.replace(envelope, run_id="r2")
        assert copied.run_id == "r2" and envelope.run_id == "r"
        assert decode(encode(copied)) == copied
        assert envelope.payload.model_dump() == event.model_dump()
        assert envelope.to_json()["payload"] == event.model_dump(mode="json")
        assert envelope.payload.model_fields_set == set(type(event).model_fields)
        with pytest.raises(ValueError, match="frozen"):
            envelope.payload.__setattr__(next(iter(type(event).model_fields)), None)
        with pytest.raises(AttributeError, match="immutable"):
            envelope.run_id = "r2"


def test_a_body_with_any_field_changed_decodes_or_is_refused_as_the_model_says(monkeypatch):
    """The fast path never accepts what the model refuses, never decodes a value differently, and leaves the
    model's lax coercions (a str of digits for an int) and its error messages as they were."""
    cases = list(bodies_with_one_field_changed())
    fast = {name: outcome(fields) for name, fields in cases}
    with monkeypatch.context() as patch:
        pydantic_only(patch)
        reference = {name: outcome(fields) for name, fields in cases}
    differing = [name for name in fast if fast[name] != reference[name]]
    assert differing == []
    kinds = [kind for kind, _ in reference.values()]
    assert kinds.count("decoded") > 100 and kinds.count("refused") > 1000  # both kinds are compared


@pytest.mark.parametrize("payload_model", ["field validator", "before validator", "unknown constraint",
                                           "extra allowed", "alias", "not frozen"])
def test_a_model_with_a_check_no_struct_expresses_has_no_fast_path(payload_model):
    class Base(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

    class WithFieldValidator(Base):
        n: int

        @field_validator("n")
        @classmethod
        def _odd(cls, n):
            return n

    class WithBeforeValidator(Base):
        n: int

        @model_validator(mode="before")
        @classmethod
        def _rename(cls, data):
            return data

    class WithMaxLength(Base):
        items: Annotated[list[int], Field(max_length=3)]

    class ExtraAllowed(BaseModel):
        model_config = ConfigDict(extra="allow", frozen=True)
        n: int

    class NotFrozen(BaseModel):
        model_config = ConfigDict(extra="forbid")
        n: int

    class Aliased(Base):
        n: int = Field(alias="number")

    models = {"field validator": WithFieldValidator, "before validator": WithBeforeValidator,
              "unknown constraint": WithMaxLength, "extra allowed": ExtraAllowed, "alias": Aliased,
              "not frozen": NotFrozen}
    model = models[payload_model]
    assert fast_decoder(model, Envelope) is None


def test_a_frozen_event_that_forbids_extra_fields_has_one():
    class Plain(Event):
        TYPE = "Plain"
        n: Annotated[int, Field(ge=0)]
        names: list[str] = Field(default_factory=list)

    fast = fast_decoder(Plain, Envelope)
    head = {"type": "Plain", "schema_version": 1, "event_id": "e", "run_id": "r", "time": 1.5}
    decoded = fast(msgspec.msgpack.encode({**head, "payload": {"n": 3}}))
    assert decoded == Envelope(**head, payload=Plain(n=3))
    for refused in ({**head, "payload": {"n": -1}}, {**head, "type": "Other", "payload": {"n": 3}},
                    {**head, "schema_version": 2, "payload": {"n": 3}}):
        assert fast(msgspec.msgpack.encode(refused)) is None  # the model's validation or decode() says why
