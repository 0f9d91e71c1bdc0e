"""The bytes of a weight sync over a collective: tensors packed into buckets, and the delta of one version
against the one before, as both ends of the transfer compute them.

A sync sends a list of TensorSpec (name, dtype, shape; in the update request, as JSON) and then the tensors'
bytes, packed back to back into buckets of at most `bucket_bytes` (a tensor larger than that is a bucket of
its own): one broadcast per bucket instead of one per tensor. Both ends cut the buckets from the same specs
with `plan_buckets`, so nothing else needs to travel.

A delta sends, for each tensor that changed since the base version, the flat indices of its changed elements
(int32 while the tensor has fewer than 2**31 elements, else int64) and their new values, compared at the
serving dtype's bits: an element counts as changed when its bytes differ, so a value that rounds to the same
bf16 is not sent. `delta_specs` turns that into the specs the buckets are cut from (two per changed tensor);
the receiver applies it to its copy of the base (`apply_delta`).

Library module: shared/inference/weight_transport.py (the trainer) and shared/inference/vllm_weight_engine.py
(a vLLM worker) use it.
    python -m pytest tests/unit/shared/inference/test_weight_buckets.py -q
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Sequence

import torch

DEFAULT_BUCKET_BYTES = 256 << 20
"""What one broadcast carries at most: large enough that a 7B policy moves in ~60 broadcasts, small enough
that a bucket's copy on each end is no burden."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    """torch dtype name without the `torch.` (JSON-safe): float32, bfloat16, int32, ..."""
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{self.name}: {self.dtype!r} is not a torch dtype")
        return dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    def to_json(self) -> list:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_json(cls, item: Sequence) -> TensorSpec:
        name, dtype, shape = item
        return cls(str(name), str(dtype), tuple(int(size) for size in shape))


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """The specs' indices cut into consecutive buckets of at most `bucket_bytes` (one larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index, spec in enumerate(specs):
        if current and size + spec.nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


def pack(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 buffer of the tensors' bytes, back to back."""
    parts = [tensor.detach().contiguous().reshape(-1).view(torch.uint8) for tensor in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `pack` put in `buffer`, as views of it, by their specs."""
    offset = 0
    for spec in specs:
        end = offset + spec.nbytes
        yield spec.name, buffer[offset:end].view(spec.torch_dtype).reshape(spec.shape)
        offset = end
    if offset != buffer.numel():
        raise ValueError(f"a bucket of {buffer.numel()} bytes holds {offset} bytes of tensors")


def bucket_size(specs: Sequence[TensorSpec], indices: Sequence[int]) -> int:
    return sum(specs[index].nbytes for index in indices)


# ------------------------------------------------------------------------------------------------- deltas
@dataclasses.dataclass
class TensorDelta:
    """The changed elements of one tensor: flat indices and their new values."""

    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor
    values: torch.Tensor


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width, so that comparing them compares bytes (NaN equal
    to itself, -0.0 not equal to 0.0)."""
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(width)


def tensor_delta(name: str, base: torch.Tensor, new: torch.Tensor) -> TensorDelta | None:
    """What changed from `base` to `new` (same shape and dtype), or None when nothing did."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(f"{name}: base {base.dtype}{tuple(base.shape)} and new "
                         f"{new.dtype}{tuple(new.shape)} differ in shape or dtype")
    changed = (_bits(base).reshape(-1) != _bits(new).reshape(-1)).nonzero().reshape(-1)
    if changed.numel() == 0:
        return None
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    return TensorDelta(name, tuple(new.shape), changed.to(index_dtype), new.reshape(-1)[changed].clone())


def delta_specs(deltas: Sequence[TensorDelta]) -> list[TensorSpec]:
    """The specs a delta travels as: its indices then its values, per changed tensor."""
    specs = []
    for delta in deltas:
        specs.append(TensorSpec.of(f"{delta.name}#indices", delta.indices))
        specs.append(TensorSpec.of(f"{delta.name}#values", delta.values))
    return specs


def delta_tensors(deltas: Sequence[TensorDelta]) -> list[torch.Tensor]:
    return [tensor for delta in deltas for tensor in (delta.indices, delta.values)]


def apply_delta(base: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
    """Write a delta's values into `base` (in place)."""
    if indices.numel() != values.numel():
        raise ValueError(f"a delta of {indices.numel()} indices and {values.numel()} values")
    flat = base.view(-1)
    if indices.numel() and int(indices.max()) >= flat.numel():
        raise ValueError(f"a delta index {int(indices.max())} is outside a tensor of {flat.numel()} elements")
    flat[indices.long()] = values.to(base.dtype)
