"""Token arrays in events: ids, logprobs and masks are Python lists in the models and packed little-endian
int32 / float32 / int8 bytes on the wire (shared/contract/events.py's contract;
`python bench/bench_encoding.py` measures them against JSON lists). An array is bounded by
MAX_SEQUENCE_TOKENS before it is unpacked, so one entry cannot make a reader allocate without bound.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any

import numpy as np
from pydantic import PlainSerializer, SerializationInfo, ValidatorFunctionWrapHandler, WrapValidator

MAX_SEQUENCE_TOKENS = 1 << 19
"""Most items a token array (ids, logprobs, mask) of one event may hold: longer than any context this
code trains on, and small enough that decoding one entry stays within tens of MB."""


def _bounded(length: int) -> None:
    if length > MAX_SEQUENCE_TOKENS:
        raise ValueError(f"array of {length} items is longer than MAX_SEQUENCE_TOKENS "
                         f"({MAX_SEQUENCE_TOKENS})")


def _pack(dtype: str):
    item = np.dtype(dtype)
    packing = f"<{{}}{item.char}"

    def serialize(values: list, info: SerializationInfo) -> Any:
        if info.mode == "json":
            return list(values)
        try:  # struct packs a list several times faster than numpy converts one
            return struct.pack(packing.format(len(values)), *values)
        except OverflowError:  # a float beyond float32's range: numpy rounds it to infinity, as it always did
            return np.asarray(values, dtype=dtype).tobytes()

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)):
            if len(value) % item.itemsize:
                raise ValueError(f"packed {dtype} array has {len(value)} bytes, not a multiple of the item "
                                 "size")
            # before unpacking: a huge array is refused without allocating it
            _bounded(len(value) // item.itemsize)
            # every item unpacks to a Python int or float: validating the list again would only copy it
            return np.frombuffer(value, dtype=item).tolist()
        if isinstance(value, (list, tuple)):
            _bounded(len(value))
        return handler(value)

    return WrapValidator(validate), PlainSerializer(serialize)


TokenIds = Annotated[list[int], *_pack("<i4")]
"""Token ids; packed as int32 bytes on the wire."""
Floats = Annotated[list[float], *_pack("<f4")]
"""Logprobs and similar per-token floats; packed as float32 bytes on the wire."""
Mask = Annotated[list[int], *_pack("<i1")]
"""0/1 per token; packed as int8 bytes on the wire."""
