"""Token arrays in events: ids, logprobs and masks are packed little-endian int32 / float32 / int8 bytes, on
the wire and in the models alike (shared/contract/events.py's contract; `python bench/bench_encoding.py`
measures them against JSON lists).

A model holds each as a `PackedArray`: a read-only sequence of Python numbers over its bytes. Decoding an
event therefore never unpacks its arrays (a 512-token segment's three would cost more than the rest of its
decoding), a reader that only passes an event over pays nothing for them, and one that keeps events (the
reward service, until a group is complete) keeps 4 bytes a token rather than a Python int. An array built
from a list is packed when its model is made, which checks that every item fits its type. An array is bounded
by MAX_SEQUENCE_TOKENS before it is unpacked or packed, so one entry cannot make a reader allocate without
bound.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer, PlainValidator, SerializationInfo

MAX_SEQUENCE_TOKENS = 1 << 19
"""Most items a token array (ids, logprobs, mask) of one event may hold: longer than any context this
code trains on, and small enough that decoding one entry stays within tens of MB."""


class PackedArray(Sequence):
    """A read-only sequence of ints or floats held as packed little-endian bytes of one numpy dtype.

    It reads like the list it was made from: len, indexing (a slice is a list), iteration, `==` item by item
    against a list, a tuple or another PackedArray (byte for byte when of the same dtype), `+` (a list).
    `numpy()` is the array itself, without a copy, for code that computes on it; `packed` is its bytes, as the
    wire carries them."""

    __slots__ = ("_array", "dtype", "packed")

    def __init__(self, packed: bytes, dtype: np.dtype):
        self.packed = packed
        self.dtype = dtype
        self._array: np.ndarray | None = None  # made when first asked for: most decoded arrays never are

    def numpy(self) -> np.ndarray:
        """The items as a read-only numpy array over the packed bytes."""
        if self._array is None:
            self._array = np.frombuffer(self.packed, dtype=self.dtype)
        return self._array

    def tolist(self) -> list:
        return self.numpy().tolist()

    def __len__(self) -> int:
        return len(self.packed) // self.dtype.itemsize

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.numpy()[index].tolist()
        return self.numpy()[index].item()

    def __iter__(self) -> Iterator:
        return iter(self.tolist())

    def __contains__(self, value: object) -> bool:
        return value in self.tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray) and other.dtype == self.dtype:
            return self.packed == other.packed
        if isinstance(other, (list, tuple, PackedArray)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # like the list it stands for

    def __add__(self, other: Sequence) -> list:
        return self.tolist() + list(other)

    def __radd__(self, other: Sequence) -> list:
        return list(other) + self.tolist()

    def __repr__(self) -> str:
        return repr(self.tolist())

    def __reduce__(self):
        return PackedArray, (self.packed, self.dtype)


def packed_bytes(value: Any) -> bytes:
    """A PackedArray's bytes: the msgpack encoder's hook for the one type of the contract it cannot encode."""
    if isinstance(value, PackedArray):
        return value.packed
    raise TypeError(f"an event field holds a {type(value).__name__}, which the wire format cannot encode")


def _bounded(length: int) -> None:
    if length > MAX_SEQUENCE_TOKENS:
        raise ValueError(f"array of {length} items is longer than MAX_SEQUENCE_TOKENS "
                         f"({MAX_SEQUENCE_TOKENS})")


def _packed_array(dtype: str, kind: str):
    item = np.dtype(dtype)
    packing = f"<{{}}{item.char}"

    def pack(values: Sequence) -> bytes:
        try:  # struct packs a list several times faster than numpy converts one, and checks every item's type
            return struct.pack(packing.format(len(values)), *values)
        except OverflowError:  # a float beyond float32's range: numpy rounds it to infinity, as it always did
            with np.errstate(over="ignore"):
                return np.asarray(values, dtype=item).tobytes()
        except struct.error as exc:
            raise ValueError(f"not an array of {kind}: {exc}") from None

    def validate(value: Any) -> PackedArray:
        if isinstance(value, (bytes, bytearray, memoryview)):  # the wire's
            count, rest = divmod(len(value), item.itemsize)
            if rest:
                raise ValueError(f"packed {dtype} array has {len(value)} bytes, not a multiple of the item "
                                 "size")
            _bounded(count)  # before unpacking: a huge array is refused without allocating it
            return PackedArray(value if type(value) is bytes else bytes(value), item)
        if isinstance(value, PackedArray) and value.dtype == item:
            return value
        if isinstance(value, np.ndarray):
            value = value.tolist()
        if not isinstance(value, (list, tuple, PackedArray)):
            # a ValueError: pydantic makes it a ValidationError, which a TypeError would not be
            found = type(value).__name__
            raise ValueError(f"expected a list of {kind} or their packed bytes, not {found}")
        _bounded(len(value))
        return PackedArray(pack(value), item)

    def serialize(values: PackedArray, info: SerializationInfo) -> Any:
        return values.tolist() if info.mode == "json" else values.packed

    return PlainValidator(validate), PlainSerializer(serialize)


TokenIds = Annotated[PackedArray, *_packed_array("<i4", "int32 token ids")]
"""Token ids; packed as int32 bytes."""
Floats = Annotated[PackedArray, *_packed_array("<f4", "float32 numbers")]
"""Logprobs and similar per-token floats; packed as float32 bytes."""
Mask = Annotated[PackedArray, *_packed_array("<i1", "int8 mask values")]
"""0/1 per token; packed as int8 bytes."""
