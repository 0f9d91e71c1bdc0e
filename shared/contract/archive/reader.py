"""Reading a run's stream archive: its parts listed afresh on every call, entries each id once.

A recorder that crashed between writing a part and advancing its position writes the same entries
again into an overlapping part; the reader returns each entry id once, in entry-id order, and
refuses (ArchiveError) a part that is unreadable, of an unknown format version, or not what its
name says.

    reader = ArchiveReader("runs", "run1")
    reader.validate()                       # every part readable, every entry decodes
    for entry in reader.entries():          # all streams, merged in entry-id order
        entry.entry_id, entry.stream, entry.envelope

    python -m pytest tests/unit/shared/contract/test_archive.py -q
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rollstream.shared.contract.archive.layout import (
    FORMAT_VERSION,
    PART_NAME,
    SCHEMA,
    ArchivePart,
    EntryKey,
    format_id,
    hour_of,
    parse_id,
)
from rollstream.shared.contract.bus import STREAMS, StreamName
from rollstream.shared.contract.events import Envelope, EventDecodeError, decode
from rollstream.shared.errors import ArchiveError
from rollstream.shared.runtime.storage import Storage

_TEMP_NAME = re.compile(r"\.parquet\.tmp-[0-9a-f]+$")


@dataclass(frozen=True, eq=False)
class ArchivedEntry:
    """One archived stream entry. `envelope` decodes it on first use."""

    stream: StreamName
    entry_id: str
    ms: int
    seq: int
    type: str | None
    v: str | None
    body: bytes | None
    extra: dict[bytes, bytes]
    path: str
    """The part it was read from, for error messages."""

    @property
    def key(self) -> EntryKey:
        return self.ms, self.seq

    @property
    def fields(self) -> dict[bytes, bytes]:
        """The entry's fields as redis-py returned them from the stream."""
        out = {}
        if self.type is not None:
            out[b"type"] = self.type.encode()
        if self.v is not None:
            out[b"v"] = self.v.encode()
        if self.body is not None:
            out[b"body"] = self.body
        out.update(self.extra)
        return out

    @cached_property
    def envelope(self) -> Envelope:
        """The decoded event; ArchiveError naming the part and the entry if it is not one this code
        reads (unknown type or schema version, malformed body)."""
        try:
            return decode(self.fields)
        except EventDecodeError as exc:
            raise ArchiveError(f"{self.path} entry {self.entry_id}: {exc}") from exc


def list_runs(storage_uri: str) -> list[str]:
    """Runs in a storage directory that have an archive, sorted by name."""
    storage = Storage(storage_uri)
    infos = storage.fs.get_file_info(pafs.FileSelector(storage.root, allow_not_found=True))
    runs = []
    for info in infos:
        if info.type == pafs.FileType.Directory:
            archive = storage.fs.get_file_info(storage.path(info.base_name, "archive"))
            if archive.type == pafs.FileType.Directory:
                runs.append(info.base_name)
    return sorted(runs)


class ArchiveReader:
    """Reads one run's archive. Parts are listed afresh on every call, so a reader sees what a
    running recorder has written since."""

    def __init__(self, storage_uri: str, run_id: str) -> None:
        self.storage = Storage(storage_uri)
        self.run_id = run_id
        self.root = self.storage.path(run_id, "archive")

    def _all_parts(self) -> dict[StreamName, list[ArchivePart]]:
        infos = self.storage.fs.get_file_info(
            pafs.FileSelector(self.root, recursive=True, allow_not_found=True))
        out: dict[StreamName, list[ArchivePart]] = {}
        prefix = self.root.rstrip("/") + "/"
        for info in infos:
            if info.type != pafs.FileType.File or _TEMP_NAME.search(info.base_name):
                continue  # a write interrupted before its rename: never part of the archive
            relative = info.path[len(prefix):].split("/")
            match = PART_NAME.match(info.base_name)
            if len(relative) != 3 or relative[0] not in STREAMS or not match:
                raise ArchiveError(f"{info.path}: not an archive part (expected "
                                   f"<stream>/<YYYYMMDD-HH>/part-<first id>-<last id>.parquet "
                                   f"under {self.root})")
            stream, hour, _ = relative
            part = ArchivePart(stream, info.path, match[1], match[2])
            if part.first > part.last or hour_of(part.first[0]) != hour:
                raise ArchiveError(f"{info.path}: its name does not fit its place "
                                   f"(ids {part.first_id}..{part.last_id} under hour {hour})")
            out.setdefault(stream, []).append(part)
        for parts in out.values():
            parts.sort(key=lambda p: (p.first, p.last))
        return out

    def streams(self) -> list[StreamName]:
        """Streams that have at least one part, in the bus's stream order."""
        found = self._all_parts()
        return [stream for stream in STREAMS if stream in found]

    def parts(self, stream: StreamName) -> list[ArchivePart]:
        """A stream's parts, oldest first; overlapping ones where a recorder crashed mid-flush."""
        check_stream(stream)
        return self._all_parts().get(stream, [])

    def entries(self, streams: Iterable[StreamName] | StreamName | None = None,
                after: str | None = None) -> Iterator[ArchivedEntry]:
        """Entries of the given streams (default: all), each entry id once, in entry-id order; several
        streams are merged by (ms, seq), ties in the bus's stream order. `after`: only entries with a
        greater id (parts wholly before it are not read)."""
        if isinstance(streams, str):
            streams = [streams]
        found = self._all_parts()
        wanted = [s for s in STREAMS if s in found] if streams is None else list(streams)
        for stream in wanted:
            check_stream(stream)
        bound = parse_id(after) if after else None
        iterators = [
            self._stream_entries([p for p in found.get(stream, []) if bound is None or p.last > bound], bound)
            for stream in wanted
        ]
        if len(iterators) == 1:
            yield from iterators[0]
            return
        order = {stream: i for i, stream in enumerate(STREAMS)}
        yield from heapq.merge(*iterators, key=lambda e: (e.ms, e.seq, order[e.stream]))

    def validate(self) -> dict[StreamName, int]:
        """Read every part and decode every entry; ArchiveError on the first damage. Returns the
        number of distinct entries per stream."""
        counts: dict[StreamName, int] = {}
        for stream in self.streams():
            counts[stream] = 0
            for entry in self.entries(stream):
                _ = entry.envelope  # decoding is the check: ArchiveError on the first entry that fails
                counts[stream] += 1
        return counts

    def _stream_entries(self, parts: list[ArchivePart],
                        after: EntryKey | None = None) -> Iterator[ArchivedEntry]:
        # Only parts whose id ranges overlap (a flush redone after a crash) are read together, so
        # memory holds about one part however long the run.
        last: EntryKey | None = after
        for group in _overlapping(parts):
            if len(group) == 1:
                merged: Iterable[ArchivedEntry] = self._read_part(group[0])
            else:
                merged = heapq.merge(*(self._read_part(p) for p in group), key=lambda e: e.key)
            for entry in merged:
                if last is not None and entry.key <= last:
                    continue
                last = entry.key
                yield entry

    def _read_part(self, part: ArchivePart) -> list[ArchivedEntry]:
        try:
            table = pq.read_table(part.path, filesystem=self.storage.fs)
        except (pa.ArrowException, OSError) as exc:
            raise ArchiveError(f"{part.path}: not a readable Parquet file ({exc})") from exc
        metadata = table.schema.metadata or {}
        version = metadata.get(b"rollstream.archive", b"").decode()
        if version != FORMAT_VERSION:
            raise ArchiveError(f"{part.path}: archive format {version or 'missing'!r} is not supported "
                               f"(this code reads {FORMAT_VERSION!r})")
        stream = metadata.get(b"stream", b"").decode()
        if stream != part.stream:
            raise ArchiveError(f"{part.path}: holds entries of stream {stream!r}, not {part.stream!r}")
        missing = [f"{field.name} ({field.type})" for field in SCHEMA
                   if field.name not in table.schema.names
                   or table.schema.field(field.name).type != field.type]
        if missing:
            raise ArchiveError(f"{part.path}: missing or mistyped columns: {', '.join(missing)}")
        columns = {name: table.column(name).to_pylist() for name in SCHEMA.names}
        out = []
        previous: EntryKey | None = None
        for i, entry_id in enumerate(columns["entry_id"]):
            key = (columns["ms"][i], columns["seq"][i])
            if entry_id is None or parse_id(entry_id) != key:
                raise ArchiveError(f"{part.path} entry {entry_id}: "
                                   f"id does not match its ms/seq columns {key}")
            if previous is not None and key <= previous:
                raise ArchiveError(f"{part.path} entry {entry_id}: out of order after {format_id(previous)}")
            previous = key
            out.append(ArchivedEntry(part.stream, entry_id, key[0], key[1], columns["type"][i],
                                     columns["v"][i], columns["body"][i], dict(columns["extra"][i] or ()),
                                     part.path))
        if not out or out[0].entry_id != part.first_id or out[-1].entry_id != part.last_id:
            held = f"{out[0].entry_id}..{out[-1].entry_id}" if out else "no entries"
            raise ArchiveError(f"{part.path}: holds {held}, its name says {part.first_id}..{part.last_id}")
        return out


def _overlapping(parts: list[ArchivePart]) -> Iterator[list[ArchivePart]]:
    group: list[ArchivePart] = []
    end: EntryKey | None = None
    for part in parts:
        if group and part.first > end:
            yield group
            group = []
        end = part.last if not group else max(end, part.last)
        group.append(part)
    if group:
        yield group


def check_stream(stream: str) -> None:
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; streams are {', '.join(STREAMS)}")
