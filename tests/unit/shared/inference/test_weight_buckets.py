"""The bytes of a collective weight sync (rollstream.shared.inference.weight_buckets): buckets both ends cut
alike, packing that round-trips every dtype, and deltas that carry exactly the changed elements at the serving
dtype's bits; and a gloo group of real processes broadcasting them (weight_group.py)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from rollstream.shared.inference.weight_buckets import (
    TensorSpec,
    apply_delta,
    delta_specs,
    delta_tensors,
    pack,
    plan_buckets,
    tensor_delta,
    unpack,
)
from rollstream.shared.inference.weight_group import GroupAddress, join


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(10, 4, generator=generator),
        "norm": torch.randn(4, generator=generator).to(torch.bfloat16),
        "big": torch.randn(64, 64, generator=generator),
        "count": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    }


def test_buckets_hold_at_most_their_size_and_a_larger_tensor_alone_in_order():
    specs = [TensorSpec.of(name, tensor) for name, tensor in tensors().items()]
    buckets = plan_buckets(specs, bucket_bytes=200)
    assert [index for bucket in buckets for index in bucket] == list(range(len(specs)))
    for bucket in buckets:
        size = sum(specs[index].nbytes for index in bucket)
        assert size <= 200 or len(bucket) == 1
    assert [2] in buckets  # 64 x 64 float32 is larger than a bucket: alone
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(specs, 0)


def test_packed_tensors_unpack_bit_for_bit_and_their_specs_survive_json():
    named = tensors()
    specs = [TensorSpec.from_json(TensorSpec.of(name, tensor).to_json()) for name, tensor in named.items()]
    unpacked = dict(unpack(pack(named.values()), specs))
    assert list(unpacked) == list(named)
    for name, tensor in named.items():
        assert unpacked[name].dtype == tensor.dtype and torch.equal(unpacked[name], tensor)
    with pytest.raises(ValueError, match="holds"):
        list(unpack(pack(named.values()), specs[:-1]))
    with pytest.raises(ValueError, match="not a torch dtype"):
        _ = TensorSpec("x", "float99", (1,)).torch_dtype


def test_a_delta_carries_exactly_the_elements_whose_bits_changed():
    base = torch.randn(50, 8)
    new = base.clone()
    new[3, 2] += 1.0
    new[40] = -new[40]
    new[7, 7] = torch.nan  # a NaN is a change; the same NaN bits again would not be
    delta = tensor_delta("w", base, new)
    assert delta is not None and delta.indices.dtype == torch.int32
    assert sorted(delta.indices.tolist()) == sorted([3 * 8 + 2, *range(40 * 8, 41 * 8), 7 * 8 + 7])
    patched = base.clone()
    apply_delta(patched, delta.indices, delta.values)
    assert torch.equal(patched.view(torch.int32), new.view(torch.int32))
    assert tensor_delta("w", new, new.clone()) is None
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        tensor_delta("w", base, new.double())


def test_an_update_below_the_serving_dtypes_resolution_is_no_change():
    base = torch.ones(4, dtype=torch.bfloat16)
    assert tensor_delta("w", base, (base.float() + 1e-4).to(torch.bfloat16)) is None


def test_a_delta_travels_as_indices_then_values_per_changed_tensor():
    base = {"a": torch.zeros(6), "b": torch.zeros(2, 2)}
    new = {"a": torch.tensor([0, 1.0, 0, 0, 2.0, 0]), "b": torch.tensor([[0, 0], [0, 3.0]])}
    deltas = [tensor_delta(name, base[name], new[name]) for name in base]
    specs = delta_specs(deltas)
    assert [spec.name for spec in specs] == ["a#indices", "a#values", "b#indices", "b#values"]
    received = dict(unpack(pack(delta_tensors(deltas)), specs))
    for name in base:
        apply_delta(base[name], received[f"{name}#indices"], received[f"{name}#values"])
        assert torch.equal(base[name], new[name])
    with pytest.raises(ValueError, match="outside"):
        apply_delta(torch.zeros(2), torch.tensor([5], dtype=torch.int32), torch.tensor([1.0]))


def _receive(group: GroupAddress, rank: int, specs: list, results) -> None:
    communicator = join(group, rank)
    for indices in plan_buckets(specs, 256):
        buffer = torch.empty(sum(specs[i].nbytes for i in indices), dtype=torch.uint8)
        communicator.broadcast(buffer, 0)
        for name, tensor in unpack(buffer, [specs[i] for i in indices]):
            results.put((rank, name, tensor.clone()))
    communicator.close()


def test_a_gloo_group_of_processes_receives_every_bucket_rank_0_broadcasts():
    from rollstream.shared.inference.weight_transport import free_port

    named = tensors()
    specs = [TensorSpec.of(name, tensor) for name, tensor in named.items()]
    group = GroupAddress("gloo", "127.0.0.1", free_port(), world_size=3, generation=1, timeout_s=60)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    receivers = [context.Process(target=_receive, args=(group, rank, specs, results)) for rank in (1, 2)]
    for process in receivers:
        process.start()
    sender = join(group, 0)
    for indices in plan_buckets(specs, 256):
        sender.broadcast(pack(list(named.values())[i] for i in indices), 0)
    received = [results.get(timeout=60) for _ in range(2 * len(named))]
    for process in receivers:
        process.join(timeout=60)
        assert process.exitcode == 0
    sender.close()
    for rank, name, tensor in received:
        assert torch.equal(tensor, named[name]), (rank, name)
    assert sorted({rank for rank, _, _ in received}) == [1, 2]
