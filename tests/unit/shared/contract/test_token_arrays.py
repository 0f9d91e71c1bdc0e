import pickle

import numpy as np
import pytest
from pydantic import ValidationError

from rollstream.shared.contract.events import TrajectoryTurn, decode, encode_event
from rollstream.shared.contract.token_arrays import PackedArray


def turn(**overrides) -> TrajectoryTurn:
    fields = dict(turn=0, offset=3, appended_ids=[1, 2, 3], response_ids=[40, 41], logprobs=[-0.5, -1.25],
                  policy_version=0, policy_version_end=0, finish_reason="stop", server_url="http://a")
    return TrajectoryTurn(**{**fields, **overrides})


def test_a_decoded_token_array_reads_like_the_list_it_was_made_from():
    ids = decode(encode_event(turn(appended_ids=[7, 8, 9, 10]), run_id="r")).payload.appended_ids
    assert isinstance(ids, PackedArray)
    assert len(ids) == 4 and ids[0] == 7 and ids[-1] == 10 and ids[1:3] == [8, 9]
    assert list(ids) == [7, 8, 9, 10] and tuple(ids) == (7, 8, 9, 10) and sum(ids) == 34 and 9 in ids
    assert ids == [7, 8, 9, 10] and [7, 8, 9, 10] == ids and ids != [7, 8, 9]
    assert [1] + ids == [1, 7, 8, 9, 10] and ids + [11] == [7, 8, 9, 10, 11]
    assert type(ids[0]) is int and repr(ids) == "[7, 8, 9, 10]"
    assert pickle.loads(pickle.dumps(ids)) == ids


def test_numpy_reads_the_packed_bytes_without_a_copy_and_cannot_write_them():
    logprobs = turn().logprobs
    array = logprobs.numpy()
    assert array.dtype == np.dtype("<f4") and array.tolist() == [-0.5, -1.25]
    with pytest.raises(ValueError, match="read-only"):
        array[0] = 0.0


def test_a_model_made_from_lists_holds_what_decoding_it_gives():
    """Packed when the model is made: the event a producer publishes equals the one its readers decode,
    logprobs rounded to float32 included."""
    made = turn(logprobs=[-0.1, -1 / 3])
    assert decode(encode_event(made, run_id="r")).payload == made
    assert made.logprobs == np.float32([-0.1, -1 / 3]).tolist()


@pytest.mark.parametrize("field, values, error", [
    ("response_ids", [1, 2**31], "not an array of int32 token ids"),
    ("response_ids", [1, "2"], "not an array of int32 token ids"),
    ("response_ids", 7, "expected a list of int32 token ids"),
    ("logprobs", [-0.5, "low"], "not an array of float32 numbers"),
    ("response_ids", b"\x01\x00\x00", "not a multiple of the item size"),
])
def test_an_array_whose_items_do_not_fit_its_type_is_refused_when_the_model_is_made(field, values, error):
    with pytest.raises(ValidationError, match=error) as raised:
        turn(**{field: values})
    assert raised.value.errors()[0]["loc"] == (field,)
