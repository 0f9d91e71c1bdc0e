"""rollstream's weight-transfer engine inside a vLLM server: receives a new policy version broadcast by the
trainer over a collective (gloo on CPUs, NCCL on GPUs), whole or as a delta, and loads it in place.

vLLM creates one per worker when the server starts with `--weight-transfer-config '{"backend": "rollstream"}'`
(the name `register` gives it through vLLM's `vllm.general_plugins` entry point, see pyproject.toml), and
drives it through the server's own weight-update endpoints, which the trainer calls
(shared/inference/weight_transport.py):
- POST /init_weight_transfer_engine {"init_info": {"group": GroupAddress, "rank_offset": N, "keep_base": b}}
  joins the group (weight_group.py) at rank offset + this worker's rank; called again, it leaves the old group
  for the new one (a server joined or left);
- POST /start_weight_update, then /update_weights {"update_info": {"kind": "full" | "delta", ...}} while the
  trainer broadcasts the buckets (weight_buckets.py), then /finish_weight_update {"weight_version": "N"}.

A full update loads every tensor through vLLM's layerwise reload, as a checkpoint reload does (a tied head
arrives as its own tensor: shared/inference/serving_weights.py says why). With `keep_base`, the engine keeps a
host copy of what it loaded, so that the next version can arrive as a delta against it: the changed elements
are written into the copy, and every tensor of each layer that changed is loaded again from it (a vLLM layer
that loads only some of its tensors would be processed half-loaded; on the CPU, linear layers keep packed
copies of their weights, so patching parameters in place would not reach the matmuls).

Not imported by rollstream's services: it runs in vLLM's worker processes.
    python -m pytest tests/integration/test_collective_weight_sync.py -q
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    layerwise_groups,
)

from rollstream.shared.inference.weight_buckets import (
    TensorSpec,
    apply_delta,
    bucket_size,
    plan_buckets,
    unpack,
)
from rollstream.shared.inference.weight_group import Communicator, GroupAddress, join

ENGINE_NAME = "rollstream"


@dataclasses.dataclass
class CollectiveInitInfo(WeightTransferInitInfo):
    group: dict[str, Any]
    rank_offset: int
    keep_base: bool = True


@dataclasses.dataclass
class CollectiveUpdateInfo(WeightTransferUpdateInfo):
    kind: str
    """full: every tensor; delta: the changed elements of the changed tensors against `base_version`."""
    specs: list[list]
    """TensorSpec.to_json() of what is broadcast, in order: the tensors (full), or each changed tensor's
    indices and values (delta)."""
    bucket_bytes: int
    version: int
    base_version: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("full", "delta"):
            raise ValueError(f"update kind {self.kind!r}: full or delta")
        if self.kind == "delta" and self.base_version is None:
            raise ValueError("a delta update needs the base_version it was made against")


class CollectiveWeightEngine(WeightTransferEngine[CollectiveInitInfo, CollectiveUpdateInfo]):
    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.communicator: Communicator | None = None
        self.keep_base = False
        self.base: dict[str, torch.Tensor] = {}
        """Host copy of the last full version loaded, by checkpoint name, in the order it arrived."""
        self.base_version: int | None = None
        self.last_kind = "full"

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        self.shutdown()
        group = GroupAddress.from_json(init_info.group)
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        with self.on_device():  # the RPC's thread need not be on the worker's device
            self.communicator = join(group, init_info.rank_offset + worker_rank)
        self.keep_base = init_info.keep_base

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        # after a delta, the layers it did not touch keep their tensors, which vLLM logs as a warning each
        layerwise_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = layerwise_log.level
        if self.last_kind == "delta":
            layerwise_log.setLevel(logging.ERROR)
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            layerwise_log.setLevel(level)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: CollectiveUpdateInfo) -> None:
        if self.communicator is None:
            raise RuntimeError("the weight-transfer group is not joined: call /init_weight_transfer_engine")
        specs = [TensorSpec.from_json(item) for item in update_info.specs]
        self.last_kind = update_info.kind
        if update_info.kind == "full":
            self.receive_full(specs, update_info.bucket_bytes)
        else:
            if update_info.base_version != self.base_version or not self.base:
                self.base_version = None
                raise ValueError(f"a delta against v{update_info.base_version}, but this server holds "
                                 f"{'no base' if not self.base else f'v{self.base_version}'}: send it whole")
            self.receive_delta(specs, update_info.bucket_bytes)
        self.base_version = update_info.version if self.keep_base else None

    def buckets(self, specs: list[TensorSpec], bucket_bytes: int):
        """Each bucket the trainer broadcasts, received: its (name, tensor) pairs, views of its buffer. The
        next bucket is already arriving while the caller loads one."""
        assert self.communicator is not None
        received = None
        for indices in plan_buckets(specs, bucket_bytes):
            buffer = torch.empty(bucket_size(specs, indices), dtype=torch.uint8, device=self.device)
            with self.on_device():
                arrived = self.communicator.start_broadcast(buffer, 0)
            if received is not None:
                yield received
            with self.on_device():
                arrived()
            received = list(unpack(buffer, [specs[index] for index in indices]))
        if received is not None:
            yield received

    def on_device(self) -> contextlib.AbstractContextManager:
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def receive_full(self, specs: list[TensorSpec], bucket_bytes: int) -> None:
        self.base = {}
        for pairs in self.buckets(specs, bucket_bytes):
            self.model.load_weights(pairs)
            if self.keep_base:
                self.base.update((name, tensor.to("cpu", copy=True)) for name, tensor in pairs)

    def receive_delta(self, specs: list[TensorSpec], bucket_bytes: int) -> None:
        changed: set[str] = set()
        received = [pair for pairs in self.buckets(specs, bucket_bytes) for pair in pairs]
        for (indices_name, indices), (_, values) in zip(received[0::2], received[1::2], strict=True):
            name = indices_name.removesuffix("#indices")
            if name not in self.base:
                raise ValueError(f"a delta of {name}, which the base version does not have")
            apply_delta(self.base[name], indices.cpu(), values.cpu())
            changed.add(name)
        for group in layerwise_groups(list(self.base)):
            if changed.intersection(group):
                self.model.load_weights([(name, self.base[name].to(self.device)) for name in group])

    def shutdown(self) -> None:
        if self.communicator is not None:
            self.communicator.close()
            self.communicator = None


def register() -> None:
    """vLLM's general-plugin hook (run in every vLLM process): the engine under the name `rollstream`."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    with contextlib.suppress(ValueError):  # registered already: vLLM may load its plugins twice in a process
        WeightTransferEngineFactory.register_engine(ENGINE_NAME, __name__, "CollectiveWeightEngine")
