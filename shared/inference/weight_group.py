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
from collections.abc import Callable
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
    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Callable[[], None]:
        """Begin putting rank `src`'s tensor into every other rank's (same size and dtype), in place; returns
        what waits until it is there. Broadcasts begun one after another complete in that order on every
        rank, so a rank may work on one tensor while the next arrives."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None: ...

    def close(self) -> None: ...


class TorchCommunicator:
    """A torch process group made directly on a TCP store (not torch.distributed's default group, which the
    trainer's ranks and vLLM's workers each have for themselves): ProcessGroupGloo on CPUs, ProcessGroupNCCL
    on GPUs. The same calls on both; only the group's class and the tensors' device differ."""

    def __init__(self, group: GroupAddress, rank: int) -> None:
        from torch.distributed import PrefixStore, TCPStore

        timeout = datetime.timedelta(seconds=group.timeout_s)
        self.store = TCPStore(group.address, group.port, group.world_size, is_master=rank == 0,
                              timeout=timeout, wait_for_workers=False)
        prefixed = PrefixStore(f"rollstream-weights/{group.generation}", self.store)
        if group.communication == "gloo":
            from torch.distributed import ProcessGroupGloo

            self.group = ProcessGroupGloo(prefixed, rank, group.world_size, timeout)
        else:
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = ProcessGroupNCCL(prefixed, rank, group.world_size, options)

    def start_broadcast(self, tensor: torch.Tensor, src: int = 0) -> Callable[[], None]:
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank = src
        work = self.group.broadcast([tensor], options)

        def wait() -> None:
            work.wait()
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()

        return wait

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.start_broadcast(tensor, src)()

    def close(self) -> None:
        self.group = None  # the group's connections close with the group object, the store's with the store
        self.store = None


def join(group: GroupAddress, rank: int) -> Communicator:
    """This process's place in `group` at `rank` (0 hosts the rendezvous); blocks until every rank has joined,
    or the group's timeout. With nccl, the broadcast tensors must be on this process's current CUDA device."""
    if group.communication not in ("gloo", "nccl"):
        raise ValueError(f"unknown weight-sync communication {group.communication!r}: gloo or nccl")
    return TorchCommunicator(group, rank)
