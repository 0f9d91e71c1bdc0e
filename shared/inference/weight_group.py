"""The process group a collective weight sync broadcasts over: the trainer's leading rank (rank 0) and every
worker of every policy server (ranks 1..), outside both sides' own torch.distributed worlds.

Two kinds, one interface (`broadcast(tensor, src)` in place, `close()`):
- gloo, over TCP, on CPUs: a torch ProcessGroupGloo made directly on a TCPStore the trainer hosts;
- nccl, on GPUs: vLLM's PyNcclCommunicator over its StatelessProcessGroup (the same rendezvous vLLM's own
  NCCL weight-transfer engine uses), imported only there.

Rendezvous: rank 0 (the trainer) hosts a TCP store at `address:port`; each server's workers join it with
their rank. Every (re)forming of the group is a `generation` with a port of its own, so a group re-formed
after a server joined or died never meets a peer of the one before.

Library module: the trainer's side is shared/inference/weight_transport.py, the servers' side
shared/inference/vllm_weight_engine.py.
    python -m pytest tests/unit/shared/inference/test_weight_group.py -q
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Literal, Protocol

import torch

Communication = Literal["gloo", "nccl"]


@dataclasses.dataclass(frozen=True)
class GroupAddress:
    """Where and how a sync's group meets: what the trainer tells every server in its init request."""

    communication: Communication
    address: str
    port: int
    world_size: int
    generation: int
    timeout_s: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> GroupAddress:
        return cls(communication=data["communication"], address=str(data["address"]), port=int(data["port"]),
                   world_size=int(data["world_size"]), generation=int(data["generation"]),
                   timeout_s=float(data["timeout_s"]))


class Communicator(Protocol):
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Rank `src`'s tensor into every other rank's (same size and dtype), in place."""

    def close(self) -> None: ...


class GlooCommunicator:
    def __init__(self, group: GroupAddress, rank: int) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        timeout = datetime.timedelta(seconds=group.timeout_s)
        self.store = TCPStore(group.address, group.port, group.world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
        self.group = ProcessGroupGloo(PrefixStore(f"rollstream-weights/{group.generation}", self.store), rank,
                                      group.world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        self.group = None  # gloo's connections close with the group object, the store's with the store
        self.store = None


class NcclCommunicator:
    def __init__(self, group: GroupAddress, rank: int, device: torch.device | int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        stateless = StatelessProcessGroup.create(host=group.address, port=group.port, rank=rank,
                                                 world_size=group.world_size,
                                                 store_timeout=int(group.timeout_s))
        self.communicator = PyNcclCommunicator(stateless, device=device)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.communicator.broadcast(tensor, src=src, stream=torch.cuda.current_stream())
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        self.communicator.destroy()


def join(group: GroupAddress, rank: int, device: torch.device | int | None = None) -> Communicator:
    """This process's place in `group` at `rank` (0 hosts the rendezvous); blocks until every rank has joined,
    or the group's timeout."""
    if group.communication == "gloo":
        return GlooCommunicator(group, rank)
    if group.communication == "nccl":
        return NcclCommunicator(group, rank, torch.cuda.current_device() if device is None else device)
    raise ValueError(f"unknown weight-sync communication {group.communication!r}: gloo or nccl")
