"""The recorder's archive writer: appends a run's stream entries to its archive in run storage.

`ArchiveWriter.archive_new` reads a stream with XRANGE after the archived position (it takes
nothing away from any consumer group), writes a part (layout in shared/contract/archive/layout.py),
and only then advances the position kept in Redis (shared/contract/archive/position.py, with
`...:counted:<stream>`, the entries accounted for up to it, so that entries deleted before they
were archived are noticed). A crash in between writes the same entries again into an overlapping
part; `ArchiveReader` returns each entry id once.

    python -m pytest tests/unit/services/recorder tests/unit/shared/contract/test_archive.py -q
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import redis

from rollstream.shared.contract.archive import (
    FORMAT_VERSION,
    SCHEMA,
    ArchivePart,
    RawEntry,
    archived_id,
    as_text,
    hour_of,
    parse_id,
    position_key,
)
from rollstream.shared.contract.bus import STREAMS, Bus, StreamName
from rollstream.shared.runtime.storage import Storage


def _counted_key(bus: Bus, stream: StreamName) -> str:
    return bus.keys.state("recorder", "counted", stream)


def counted_entries(bus: Bus, stream: StreamName) -> int:
    """How many entries were ever added to `stream` up to the archived position: archived, or found
    lost (see count_lost). Compared with the stream's entries-added, it tells a gap from no entries."""
    return int(bus.redis.get(_counted_key(bus, stream)) or 0)


def count_lost(bus: Bus, stream: StreamName, entries: int) -> None:
    bus.redis.incrby(_counted_key(bus, stream), entries)


def advance_archived(bus: Bus, stream: StreamName, entry_id: str, entries: int = 0) -> bool:
    """Move the archived position forward to `entry_id` and count the `entries` archived up to it;
    never backward, so that a second recorder that lags behind cannot make the first one archive
    everything again. Returns whether it moved."""
    key = position_key(bus, stream)
    with bus.redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)
                current = pipe.get(key)
                if current is not None and parse_id(as_text(current)) >= parse_id(entry_id):
                    return False
                pipe.multi()
                pipe.set(key, entry_id)
                pipe.incrby(_counted_key(bus, stream), entries)
                pipe.execute()
                return True
            except redis.WatchError:
                continue


class ArchiveWriter:
    """Appends one run's stream entries to its archive in run storage."""

    def __init__(self, storage: Storage, run_id: str) -> None:
        self.storage = storage
        self.run_id = run_id

    def write_part(self, stream: StreamName, entries: list[RawEntry]) -> ArchivePart:
        """Write entries of one stream and one hour, oldest first, as one part (atomically)."""
        if stream not in STREAMS:
            raise ValueError(f"unknown stream {stream!r}")
        if not entries:
            raise ValueError("a part needs at least one entry")
        ids = [as_text(entry_id) for entry_id, _ in entries]
        keys = [parse_id(entry_id) for entry_id in ids]
        if any(a >= b for a, b in zip(keys, keys[1:])):
            raise ValueError(f"entries of a part must be in increasing id order ({ids[0]}..{ids[-1]})")
        hour = hour_of(keys[0][0])
        if hour_of(keys[-1][0]) != hour:
            raise ValueError(f"entries {ids[0]}..{ids[-1]} span more than the hour {hour}")
        columns: dict[str, list] = {name: [] for name in SCHEMA.names}
        for entry_id, (ms, seq), (_, fields) in zip(ids, keys, entries):
            named, extra = _split_fields(fields)
            columns["entry_id"].append(entry_id)
            columns["ms"].append(ms)
            columns["seq"].append(seq)
            columns["type"].append(named.get("type"))
            columns["v"].append(named.get("v"))
            columns["body"].append(named.get("body"))
            columns["extra"].append(list(extra.items()))
        metadata = {"rollstream.archive": FORMAT_VERSION, "run_id": self.run_id, "stream": stream}
        table = pa.table(columns, schema=SCHEMA.with_metadata(metadata))
        name = f"part-{ids[0]}-{ids[-1]}.parquet"
        path = self.storage.write_table(table, self.run_id, "archive", stream, hour, name)
        return ArchivePart(stream, path, ids[0], ids[-1], len(ids))

    def archive_new(self, bus: Bus, stream: StreamName, max_entries: int,
                    until: str | None = None) -> list[ArchivePart]:
        """Archive up to `max_entries` entries after the archived position (and up to `until`,
        included): one part per hour they span, the position advanced after each part exists.
        Returns the parts written."""
        if bus.keys.run_id != self.run_id:
            raise ValueError(f"bus of run {bus.keys.run_id!r} given to the archive writer of run "
                             f"{self.run_id!r}")
        after = archived_id(bus, stream)
        raw = bus.redis.xrange(bus.keys.stream(stream), min=f"({after}" if after else "-", max=until or "+",
                               count=max_entries)
        parts = []
        for hour_entries in _by_hour(raw):
            part = self.write_part(stream, hour_entries)
            advance_archived(bus, stream, part.last_id, len(hour_entries))
            parts.append(part)
        return parts


def _split_fields(fields: dict) -> tuple[dict, dict[bytes, bytes]]:
    """The type, v and body fields, and everything else as raw bytes. A type or v that is not UTF-8
    text stays in `extra`, so that it is kept byte for byte."""
    named, extra = {}, {}
    for key, value in fields.items():
        key = key.encode() if isinstance(key, str) else key
        value = value.encode() if isinstance(value, str) else value
        if key == b"body" and "body" not in named:
            named["body"] = value
            continue
        if key in (b"type", b"v"):
            try:
                named[key.decode()] = value.decode("utf-8")
                continue
            except UnicodeDecodeError:
                pass
        extra[key] = value
    return named, extra


def _by_hour(raw: list[RawEntry]) -> Iterator[list[RawEntry]]:
    chunk: list[RawEntry] = []
    hour = None
    for entry in raw:
        entry_hour = hour_of(parse_id(as_text(entry[0]))[0])
        if chunk and entry_hour != hour:
            yield chunk
            chunk = []
        chunk.append(entry)
        hour = entry_hour
    if chunk:
        yield chunk
