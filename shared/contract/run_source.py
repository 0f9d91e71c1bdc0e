"""Where a run is read from, for whatever looks at runs (`rollstream inspect`, the console).

A run's history is read with `StreamHistory`: what the recorder trimmed from Redis comes from the archive in
storage, the rest from the live stream; a run that is only in storage is read from its archive alone.
`open_run` says where a run is (`RunSource`), `read_history` and `decoded_history` read one of its streams.
`RunDataNotFound` names what was asked for and is not there (a run, a rollout), and what is.

    python -m pytest tests/unit/cli/test_inspect.py tests/unit/services/console -q
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import redis

from rollstream.shared.contract.archive import ArchiveReader, StreamHistory, list_runs
from rollstream.shared.contract.batches import (
    BatchRow,
    TrainerLogprobs,
    read_batch,
    read_trainer_logprobs,
    trainer_logprobs_uri,
)
from rollstream.shared.contract.bus import Bus, Keys, StreamName
from rollstream.shared.contract.events import Envelope, EventDecodeError, decode
from rollstream.shared.errors import RunDataNotFound
from rollstream.shared.runtime.storage import Storage

RawEntry = tuple[str, dict]


def as_text(value: bytes | str | None) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def run_in_redis(client: redis.Redis | None, run: str) -> bool:
    return client is not None and Bus(client, run).has_keys()


def run_in_archive(storage_uri: str, run: str) -> bool:
    try:
        return run in list_runs(storage_uri)
    except OSError:
        return False


def read_history(bus: Bus | None, stream: StreamName, reader: ArchiveReader | None) -> list[RawEntry]:
    """A stream's whole history, oldest first: archived entries, then live ones (StreamHistory); the
    archive alone when the run is not in Redis."""
    if bus is None:
        return [(e.entry_id, e.fields) for e in reader.entries(stream)] if reader is not None else []
    return StreamHistory(bus, stream, reader).new_entries()


def decoded_history(bus: Bus | None, stream: StreamName,
                    reader: ArchiveReader | None) -> tuple[list[Envelope], int]:
    """The decodable events of a stream's history, and how many entries did not decode."""
    out, bad = [], 0
    for _, fields in read_history(bus, stream, reader):
        try:
            out.append(decode(fields))
        except EventDecodeError:
            bad += 1
    return out, bad


@dataclass
class RunSource:
    """Where one run is read from."""

    run: str
    storage_uri: str
    bus: Bus | None
    reader: ArchiveReader | None

    @property
    def where(self) -> str:
        return where_label(self.bus is not None, self.reader is not None)


def where_label(live: bool, archived: bool) -> str:
    return "both" if live and archived else "redis" if live else "archive" if archived else "-"


def open_run(client: redis.Redis | None, storage_uri: str, run: str) -> RunSource:
    """The run in Redis and/or in storage; RunDataNotFound when it is in neither."""
    try:
        Keys(run)
    except ValueError as exc:
        raise RunDataNotFound(str(exc)) from None
    live = run_in_redis(client, run)
    archived = run_in_archive(storage_uri, run)
    if not live and not archived:
        known = list_run_names(client, storage_uri)
        shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
        raise RunDataNotFound(f"no run {run!r} in Redis or in storage {storage_uri!r}"
                              + (f"; runs: {shown}" if known else "; no runs there at all"))
    return RunSource(run, storage_uri, Bus(client, run) if live else None,
                     ArchiveReader(storage_uri, run) if archived else None)


def list_run_names(client: redis.Redis | None, storage_uri: str) -> list[str]:
    return sorted(set(redis_runs(client)) | set(archive_runs(storage_uri)))


def redis_runs(client: redis.Redis | None) -> list[str]:
    """Run namespaces with at least one key in Redis (rs:{<run>}:...)."""
    if client is None:
        return []
    runs = {Keys.run_of(as_text(key)) for key in client.scan_iter(match="rs:*:*", count=1000)}
    return sorted(runs - {None})


def archive_runs(storage_uri: str) -> list[str]:
    try:
        return list_runs(storage_uri)
    except OSError:
        return []


def archive_count(reader: ArchiveReader, stream: StreamName) -> int:
    """Distinct entries of a stream in the archive (only the entry-id column is read)."""
    ids: set[str] = set()
    for part in reader.parts(stream):
        ids.update(pq.read_table(part.path, columns=["entry_id"], filesystem=reader.storage.fs)
                   .column("entry_id").to_pylist())
    return len(ids)


# One definition each of how an attempt, a logprob and a batch row are read, so that every view of a rollout
# (inspect trajectory, inspect diff, the console) matches them the same way.
def attempt_of(envelope: Envelope, rollout_id: str) -> str:
    attempt = getattr(envelope.payload, "attempt", "") or ""
    if attempt:
        return attempt
    prefix = f"{rollout_id}:"
    if envelope.event_id.startswith(prefix):
        parts = envelope.event_id[len(prefix):].split(":")
        if len(parts) >= 2:
            return parts[0]
    return ""


def float32_value(value: float) -> float:
    """A float32 logprob as its shortest decimal (-0.1, not -0.10000000149011612): the same float32."""
    return float(str(np.float32(value)))


def open_batch_rows(storage_uri: str, run: str, uri: str) -> list[BatchRow]:
    """A batch file's rows; a uri outside this storage (a copied storage) is looked up under it."""
    storage = Storage(storage_uri)
    return read_batch(storage, _batch_file(storage, run, uri))


def open_trainer_logprobs(storage_uri: str, run: str, batch_uri: str) -> list[TrainerLogprobs] | None:
    """The trainer's logprobs of a batch's segments (written beside it once trained); None before, or for a
    batch of a trainer that did not write them."""
    storage = Storage(storage_uri)
    path = _batch_file(storage, run, trainer_logprobs_uri(batch_uri))
    return read_trainer_logprobs(storage, path) if storage.exists(path) else None


def _batch_file(storage: Storage, run: str, uri: str) -> str:
    if storage.exists(uri):
        return uri
    return storage.path(run, "batches", uri.rsplit("/", 1)[-1])
