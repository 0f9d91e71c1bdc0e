"""How a new policy version reaches the fleet's servers: the WeightTransport interface and its two kinds.

- `disk`: every server reloads the checkpoint the trainer wrote (a path the servers see), a bounded number at
  once, each paused only while it loads: what works with any vLLM server and any storage the servers share.
- `collective`: the trainer's leading rank and every server's workers form one process group (gloo on CPUs,
  NCCL on GPUs: shared/inference/weight_group.py), and the trainer broadcasts the weights in packed buckets
  (weight_buckets.py) while every server receives them into its running model (rollstream's engine in vLLM:
  shared/inference/vllm_weight_engine.py). With `delta`, a version whose servers all hold the one before
  gets only the elements that changed since it, and the whole model when the delta would not be smaller.

A transport only loads: `push` returns each server's outcome, and shared/inference/weight_sync.py probes the
servers that loaded for logprob parity. The trainer talks to the interface alone
(services/trainer/fleet_sync.py); the setting train.weight_transport chooses the kind.

Library module.
    python -m pytest tests/unit/shared/inference/test_weight_transport.py \
        tests/integration/test_collective_weight_sync.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from rollstream.shared.errors import WeightSyncError
from rollstream.shared.inference.fleet import FleetClient
from rollstream.shared.inference.weight_buckets import (
    TensorDelta,
    TensorSpec,
    bucket_size,
    delta_specs,
    delta_tensors,
    pack,
    plan_buckets,
    tensor_delta,
)
from rollstream.shared.inference.weight_group import Communication, Communicator, GroupAddress, join
from rollstream.shared.runtime.network import free_port

log = logging.getLogger("rollstream.weight_sync")

Weights = Callable[[], Iterable[tuple[str, torch.Tensor]]]
"""The trainer's weights in checkpoint naming at the serving dtype, a fresh pass each call."""


@dataclasses.dataclass
class WeightUpdate:
    """One version as the trainer hands it to a transport."""

    version: int
    checkpoint: Path | None = None
    """Its checkpoint on disk, where one was written (the disk transport needs it)."""
    weights: Weights | None = None
    """Its tensors (a collective transport sends them)."""


@dataclasses.dataclass
class PushReport:
    """What a push did: each server's failure (None: it loaded the version), and what moved."""

    failures: dict[str, BaseException | None]
    kind: str
    """disk, full or delta."""
    bytes_sent: int = 0
    changed_fraction: float | None = None
    """Of the model's elements at the serving dtype, the share that differ from the base version (a
    collective transport keeping a base computes it whether or not it sends a delta)."""
    paused_s: float = 0.0
    """Longest time any server was paused."""

    @property
    def loaded(self) -> list[str]:
        return [url for url, failure in self.failures.items() if failure is None]


class WeightTransport(ABC):
    name: str
    needs_checkpoint: bool
    """Whether a version reaches the servers only once its checkpoint is written."""

    @abstractmethod
    async def push(self, fleet: FleetClient, urls: Sequence[str], update: WeightUpdate) -> PushReport:
        """Make each of `urls` serve `update`; never raises for one server's failure, reports it."""

    def close(self) -> None:  # noqa: B027 - a transport without resources has nothing to release
        """Release what the transport holds (its group)."""


class DiskTransport(WeightTransport):
    name = "disk"
    needs_checkpoint = True

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency

    async def push(self, fleet: FleetClient, urls: Sequence[str], update: WeightUpdate) -> PushReport:
        if update.checkpoint is None:
            raise ValueError(f"v{update.version} has no checkpoint to reload")
        at_once = asyncio.Semaphore(self.concurrency)
        paused: list[float] = []

        async def load(url: str) -> None:
            async with at_once:
                started = time.monotonic()
                try:
                    await fleet.reload_weights(url, str(update.checkpoint))
                finally:
                    paused.append(time.monotonic() - started)

        results = await asyncio.gather(*(load(url) for url in urls), return_exceptions=True)
        return PushReport(dict(zip(urls, results, strict=True)), "disk", paused_s=max(paused, default=0.0))


class CollectiveTransport(WeightTransport):
    """The trainer's side of a collective sync: rank 0 of a group it (re)forms whenever the servers it syncs
    are not the group's members."""

    name = "collective"
    needs_checkpoint = False

    def __init__(self, communication: Communication, address: str, *, delta: bool, bucket_bytes: int,
                 timeout_s: float) -> None:
        self.communication = communication
        self.address = address
        self.delta = delta
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.members: tuple[str, ...] = ()
        self.generation = 0
        self.communicator: Communicator | None = None
        self.base: dict[str, torch.Tensor] = {}
        """What every member holds (its version self.base_version), kept to make the next delta against."""
        self.base_version: int | None = None

    async def push(self, fleet: FleetClient, urls: Sequence[str], update: WeightUpdate) -> PushReport:
        if update.weights is None:
            raise ValueError(f"v{update.version}: a collective sync needs the trainer's weights")
        urls = tuple(urls)
        try:
            if urls != self.members or self.communicator is None:
                await self.form_group(fleet, urls)
            return await self.send(fleet, urls, update)
        except BaseException as exc:
            self.leave_group()
            if not isinstance(exc, Exception):
                raise
            failure = exc if isinstance(exc, WeightSyncError) else WeightSyncError(
                f"collective sync of v{update.version}: {type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            return PushReport({url: failure for url in urls}, "full")

    async def form_group(self, fleet: FleetClient, urls: tuple[str, ...]) -> None:
        """A new generation of the group: every worker of every server told to join it at its rank (a
        server's workers follow each other, after the servers before it), the trainer joining as rank 0."""
        self.leave_group()
        self.generation += 1
        workers = await asyncio.gather(*(server_workers(url, self.timeout_s) for url in urls))
        offsets = [1 + sum(workers[:index]) for index in range(len(urls))]
        # the rendezvous listens on every interface: the servers reach it at self.address
        group = GroupAddress(self.communication, self.address, free_port(""), world_size=1 + sum(workers),
                             generation=self.generation, timeout_s=self.timeout_s)
        joining = [asyncio.create_task(fleet.weight_step(url, "init_weight_transfer_engine",
                                                         "/init_weight_transfer_engine",
                                                         json={"init_info": {"group": group.to_json(),
                                                                             "rank_offset": offset,
                                                                             "keep_base": self.delta}}))
                   for url, offset in zip(urls, offsets, strict=True)]
        joined = asyncio.ensure_future(asyncio.to_thread(join, group, 0))
        # left behind when a server fails first: its rendezvous ends by the group's timeout, unheard
        joined.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            # a server that cannot be told to join fails the group at once, not after the rendezvous timeout
            done, _ = await asyncio.wait([joined, *joining], return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                raise_with_hint(task)
            self.communicator = joined.result()
        finally:
            for task in joining:
                task.cancel()
        self.members = urls
        log.info("weight-sync group formed", extra={"generation": self.generation, "servers": list(urls),
                                                    "communication": self.communication})

    def leave_group(self) -> None:
        if self.communicator is not None:
            self.communicator.close()
        self.communicator, self.members = None, ()
        self.base, self.base_version = {}, None

    async def send(self, fleet: FleetClient, urls: tuple[str, ...], update: WeightUpdate) -> PushReport:
        assert update.weights is not None
        live = {name: tensor.detach() for name, tensor in update.weights()}
        # the next delta's base is a host copy; without deltas the tensors go out from where they are
        new = live
        if self.delta:
            new = {name: tensor.to("cpu", copy=True).contiguous() for name, tensor in live.items()}
        kind, specs, tensors, fraction = self.plan(new)
        if kind == "full":
            tensors = list(live.values())
        info: dict[str, Any] = {"kind": kind, "specs": [spec.to_json() for spec in specs],
                                "bucket_bytes": self.bucket_bytes, "version": update.version}
        if kind == "delta":
            info["base_version"] = self.base_version
        started = time.monotonic()
        await fleet_step(fleet, urls, "pause", "/pause", params={"mode": "keep"})
        loading = False
        try:
            await fleet_step(fleet, urls, "start_weight_update", "/start_weight_update")
            loading = True
            receiving = [asyncio.create_task(fleet.weight_step(url, "update_weights", "/update_weights",
                                                               json={"update_info": info}))
                         for url in urls]
            try:
                await asyncio.to_thread(self.broadcast, specs, tensors)
                await asyncio.gather(*receiving)
            finally:
                for task in receiving:
                    task.cancel()
            await fleet_step(fleet, urls, "finish_weight_update", "/finish_weight_update",
                             json={"weight_version": str(update.version)})
            loading = False
            await fleet_step(fleet, urls, "reset_prefix_cache", "/reset_prefix_cache")
        finally:
            # A server whose load began and did not finish holds some layers of no version at all: it stays
            # paused until a sync loads it whole (the next attempt's), or it is restarted.
            if not loading:
                await asyncio.gather(*(fleet.weight_step(url, "resume", "/resume") for url in urls),
                                     return_exceptions=True)
        paused = time.monotonic() - started
        if self.delta:
            self.base, self.base_version = new, update.version
        return PushReport({url: None for url in urls}, kind, bytes_sent=sum(spec.nbytes for spec in specs),
                          changed_fraction=fraction, paused_s=paused)

    def plan(self, new: dict[str, torch.Tensor]) -> tuple[str, list[TensorSpec], list[torch.Tensor],
                                                          float | None]:
        """full or delta, the specs and tensors to broadcast, and the changed fraction (None without a
        base)."""
        full_specs = [TensorSpec.of(name, tensor) for name, tensor in new.items()]
        if not self.delta or self.base_version is None or set(self.base) != set(new):
            return "full", full_specs, list(new.values()), None
        deltas: list[TensorDelta] = []
        for name, tensor in new.items():
            delta = tensor_delta(name, self.base[name], tensor)
            if delta is not None:
                deltas.append(delta)
        elements = sum(tensor.numel() for tensor in new.values())
        fraction = sum(delta.values.numel() for delta in deltas) / max(elements, 1)
        specs = delta_specs(deltas)
        if sum(spec.nbytes for spec in specs) >= sum(spec.nbytes for spec in full_specs):
            return "full", full_specs, list(new.values()), fraction
        return "delta", specs, delta_tensors(deltas), fraction

    def broadcast(self, specs: list[TensorSpec], tensors: list[torch.Tensor]) -> None:
        assert self.communicator is not None
        sent = None
        for indices in plan_buckets(specs, self.bucket_bytes):
            buffer = pack(tensors[index] for index in indices)  # while the bucket before is on its way
            assert buffer.numel() == bucket_size(specs, indices)
            if self.communication == "nccl" and not buffer.is_cuda:  # a delta's, made on the host
                buffer = buffer.cuda()
            elif self.communication == "gloo" and buffer.is_cuda:
                buffer = buffer.cpu()
            if sent is not None:
                sent()
            sent = self.communicator.start_broadcast(buffer, 0)
        if sent is not None:
            sent()

    def close(self) -> None:
        self.leave_group()


async def fleet_step(fleet: FleetClient, urls: Sequence[str], step: str, path: str, **kwargs: Any) -> None:
    """One weight-update step on every server at once; the first failure raised once all have answered."""
    results = await asyncio.gather(*(fleet.weight_step(url, step, path, **kwargs) for url in urls),
                                   return_exceptions=True)
    failed = next((result for result in results if isinstance(result, BaseException)), None)
    if failed is not None:
        raise failed


def raise_with_hint(task: asyncio.Future) -> None:
    """A joining step's failure, told what to do when the server has no weight-transfer engine."""
    failure = task.exception()
    if failure is not None and "weight_transfer_config" in str(failure):
        raise WeightSyncError(f"{failure}: a collective sync needs rollstream's engine in every server: "
                              "start it with --weight-transfer-config '{\"backend\": \"rollstream\"}' "
                              "where rollstream is installed (rollstream serve-policy does), or set "
                              "train.weight_transport=disk") from failure
    task.result()


async def server_workers(url: str, timeout_s: float) -> int:
    """How many workers a vLLM server runs (tensor x pipeline x data parallel), each a rank of the group: from
    its /server_info (a development endpoint, as the weight-update ones are)."""
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        try:
            response = await http.get(f"{url}/server_info", params={"config_format": "json"})
            response.raise_for_status()
            parallel = response.json()["vllm_config"]["parallel_config"]
            return (int(parallel["tensor_parallel_size"]) * int(parallel["pipeline_parallel_size"])
                    * int(parallel["data_parallel_size"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise WeightSyncError(f"{url}: cannot read how many workers it runs from /server_info: "
                                  f"{type(exc).__name__}: {exc}") from exc


