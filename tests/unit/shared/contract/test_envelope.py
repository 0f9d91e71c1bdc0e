"""The envelope (envelope.py): the ids make_envelope and encode_event take, and what an envelope is once
decoded (picklable, shown as JSON, its time finite).

    python -m pytest tests/unit/shared/contract/test_envelope.py -q
"""

import json
import pickle

import msgspec
import pytest

from rollstream.shared.contract.events import (
    Envelope,
    EventDecodeError,
    decode,
    encode,
    encode_event,
    make_envelope,
)
from tests.unit.shared.contract.test_events import segment


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


def test_envelope_json_shows_the_payload():
    envelope = make_envelope(segment(), run_id="r")
    assert '"tokens": [5, 6, 7, 8]' in json.dumps(envelope.to_json())


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
