"""The trainer's ranks: data-parallel processes, one per device, of which the leader (rank 0) alone talks to
Redis and the fleet.

`rollstream-trainer` with train.ranks > 1 and no launcher around it becomes torchrun over itself
(launch_ranks); under a launcher of the user's own (torchrun or DeepSpeed's, over several nodes) each process
reads RANK and WORLD_SIZE. The leader holds the run's lock, consumes `batches`, checks each batch and hands
its rows to every rank (Command); every rank trains its share of each minibatch's micro-batches and takes part
in the collective steps (the checkpoint's gathering under ZeRO-3, the probe's forward), walking a batch's
roles in the run's order of them (a LoRA run: each role's adapter has an engine of its own, whose steps every
rank takes together); then the leader syncs the fleet, publishes, and tells the others what became of the
version. A rank that fails ends the group: the
launcher starts every rank again, and they resume exactly from the last published version.

Tests: tests/integration/test_trainer_restart.py (two ranks through the service, one of them killed).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace
from typing import Any, Literal, NoReturn

RANK_RESTARTS = 3
"""Times torchrun starts the whole group again after a rank failed, before the trainer exits (and its
supervisor, compose's restart policy or Kubernetes, starts it)."""


@dataclass(frozen=True)
class Command:
    """What the leader tells the other ranks, in the order they must act on it."""

    kind: Literal["standby", "start", "idle", "train", "published", "stop"]
    payload: Any = None
    """start: the PolicyUpdated to resume from (None: the starting model); train: (BatchReady, rows);
    published: the PolicyUpdated; stop: why."""


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1

    @classmethod
    def from_environment(cls) -> Ranks:
        return cls(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, command: Command | None = None) -> Command | None:
        """The leader's command, on every rank: a collective, which every rank calls with the leader."""
        if self.world_size == 1:
            return command
        import torch.distributed as dist

        box = [command if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order, on the leader (an empty list on the others); a collective."""
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        found: list[Any] | None = [None] * self.world_size if self.leader else None
        dist.gather_object(value, found, dst=0)
        return found or []

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def own_share(self, micros: list) -> tuple[list, int]:
        """This rank's micro-batches of a minibatch (every world_size-th), then zero-weight copies until every
        rank has as many: each backward is a gradient reduction and, under ZeRO-3, each forward a gather,
        which every rank must take part in. Returns them and how many are real (the copies come last)."""
        mine = micros[self.rank::self.world_size]
        each = math.ceil(len(micros) / self.world_size)
        padding = [replace(micros[0], weights=micros[0].weights.new_zeros(micros[0].weights.shape))
                   for _ in range(each - len(mine))]
        return mine + padding, len(mine)


def launch_ranks(ranks: int) -> NoReturn:
    """Become torchrun running `ranks` trainer processes on this node (this entrypoint in each)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               f"--max-restarts={RANK_RESTARTS}", "-m", "rollstream.services.trainer.main"]
    os.execv(command[0], command)
