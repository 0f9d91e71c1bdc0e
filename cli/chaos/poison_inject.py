"""Writing poison entries into a live run: `write_poison` adds one to its stream (a forged batch's file
first; a replayed batch waits for a real batch of the run to re-announce), `inject_at_rate` writes a whole
plan at a steady pace while the run trains.

    python -m pytest tests/unit/cli/test_poison.py -q
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from rollstream.cli.chaos.poison_make import EPOCH, Poison, as_entry_fields
from rollstream.shared.contract.batches import write_batch
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import BatchReady, Envelope, decode, encode
from rollstream.shared.errors import RollstreamError
from rollstream.shared.runtime.storage import Storage


class PoisonError(RollstreamError, RuntimeError):
    """The fuzzing session could not be carried out (the run did not get where it had to)."""


@dataclass
class Injected:
    poison: Poison
    entry_id: str
    fields: dict[str, bytes]
    """What was written (a replayed batch's fields are only known when it is written)."""


def real_batches(bus: Bus, injected_ids: set[tuple[str, str]]) -> list[BatchReady]:
    """The run's own BatchReady events still on the stream (not the fuzzer's)."""
    return [d.event for d in bus.read_all("batches")
            if ("batches", d.entry_id) not in injected_ids and isinstance(d.event, BatchReady)]


def write_poison(bus: Bus, storage: Storage, poison: Poison,
                 injected_ids: set[tuple[str, str]]) -> Injected | None:
    """XADD one poison (writing its batch file first); None when it needs a real batch and there is none
    yet."""
    fields = poison.fields
    if poison.needs_real_batch:
        batches = real_batches(bus, injected_ids)
        if not batches:
            return None
        real = batches[-1]
        copy = real.model_copy(update={"batch_id": f"{real.batch_id}-again"})
        fields = as_entry_fields(encode(Envelope(type=copy.TYPE, schema_version=copy.VERSION,
                                                 event_id=f"{real.batch_id}-again", run_id=bus.keys.run_id,
                                                 time=EPOCH, payload=copy)))
    if poison.batch_rows:
        batch = decode(fields).payload
        write_batch(storage, bus.keys.run_id, batch.batch_id, list(poison.batch_rows))
    entry_id = bus.redis.xadd(bus.keys.stream(poison.stream), fields)
    return Injected(poison, entry_id.decode(), fields)


def inject_at_rate(bus: Bus, storage: Storage, plan: list[Poison], rate: float, *, started: float,
                   timeout_s: float, between: Callable[[], None]) -> list[Injected]:
    """Write `plan`, in its order, at `rate` entries a second, calling `between` before each try (the
    session's look at the run); PoisonError when entries are left timeout_s after `started` (monotonic)."""
    pending = list(plan)
    injected: list[Injected] = []
    injected_ids: set[tuple[str, str]] = set()
    next_write = time.monotonic()
    while pending:
        if time.monotonic() > started + timeout_s:
            raise PoisonError(f"{len(pending)} poison entries not injected after {timeout_s:.0f}s")
        between()
        now = time.monotonic()
        if now < next_write:
            time.sleep(min(next_write - now, 0.2))
            continue
        next_write = now + 1.0 / rate
        for index, poison in enumerate(pending):
            item = write_poison(bus, storage, poison, injected_ids)
            if item is not None:
                injected.append(item)
                injected_ids.add((poison.stream, item.entry_id))
                del pending[index]
                break
            # a replayed batch waits for the run's first batch; meanwhile the next entry goes
    return injected
