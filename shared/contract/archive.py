"""Stream archives: a run's raw stream entries kept as Parquet in run storage, and read back.

    <storage>/<run>/archive/<stream>/<YYYYMMDD-HH>/part-<first entry id>-<last entry id>.parquet

The hour is the UTC hour of the first entry id's millisecond time; a part never spans two hours. A
part holds the entries as they were on the stream: the Redis entry id, its time and sequence, the
`type` and `v` fields, the msgpack `body` bytes untouched, and every other field in `extra`, so
that nothing an entry carried is lost (a malformed entry is archived as faithfully as a good one).

`ArchiveWriter.archive_new` reads a stream with XRANGE after the archived position (it takes
nothing away from any consumer group), writes a part, and only then advances the position kept in
Redis (`Keys.state("recorder", "archived", stream)`, with `...:counted:<stream>`, the entries
accounted for up to it, so that entries deleted before they were archived are noticed). A crash in
between writes the same entries again into an overlapping part; `ArchiveReader` returns each entry
id once.

`trim_stream` cuts a stream behind the slowest consumer group and, when recording, behind the
archived position: nothing undelivered, pending or unarchived is trimmed. Redis 7.0 and Valkey.

    reader = ArchiveReader("runs", "run1")
    reader.validate()                       # every part readable, every entry decodes
    for entry in reader.entries():          # all streams, merged in entry-id order
        entry.entry_id, entry.stream, entry.envelope
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cached_property

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import redis

from rollstream.shared.contract.bus import STREAMS, Bus, Delivery, StreamName
from rollstream.shared.contract.events import Envelope, EventDecodeError, decode
from rollstream.shared.errors import ArchiveError
from rollstream.shared.runtime.storage import Storage

FORMAT_VERSION = "1"
"""Written into every part's metadata; a reader refuses a part of a version it does not know."""

SCHEMA = pa.schema(
    [
        ("entry_id", pa.string()),
        ("ms", pa.int64()),
        ("seq", pa.int64()),
        ("type", pa.string()),
        ("v", pa.string()),
        ("body", pa.binary()),
        ("extra", pa.map_(pa.binary(), pa.binary())),
    ]
)

_PART_NAME = re.compile(r"^part-(\d+-\d+)-(\d+-\d+)\.parquet$")
_TEMP_NAME = re.compile(r"\.parquet\.tmp-[0-9a-f]+$")
_MAX_SEQ = 2**64 - 1


# ---------------------------------------------------------------------------------------- entry ids
EntryKey = tuple[int, int]


def parse_id(entry_id: str) -> EntryKey:
    ms, sep, seq = entry_id.partition("-")
    if not sep or not ms.isdigit() or not seq.isdigit():
        raise ValueError(f"{entry_id!r} is not a stream entry id (<ms>-<seq>)")
    return int(ms), int(seq)


def format_id(key: EntryKey) -> str:
    return f"{key[0]}-{key[1]}"


def next_id(entry_id: str) -> str:
    """The smallest entry id greater than `entry_id`."""
    ms, seq = parse_id(entry_id)
    return format_id((ms + 1, 0) if seq == _MAX_SEQ else (ms, seq + 1))


def hour_of(ms: int) -> str:
    return datetime.fromtimestamp(ms // 1000, timezone.utc).strftime("%Y%m%d-%H")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# ------------------------------------------------------------------------------------------ position
def _position_key(bus: Bus, stream: StreamName) -> str:
    return bus.keys.state("recorder", "archived", stream)


def _counted_key(bus: Bus, stream: StreamName) -> str:
    return bus.keys.state("recorder", "counted", stream)


def archived_id(bus: Bus, stream: StreamName) -> str | None:
    """The last entry id of `stream` known to be in the archive; None before the first part."""
    value = bus.redis.get(_position_key(bus, stream))
    return _text(value) if value is not None else None


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
    key = _position_key(bus, stream)
    with bus.redis.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(key)
                current = pipe.get(key)
                if current is not None and parse_id(_text(current)) >= parse_id(entry_id):
                    return False
                pipe.multi()
                pipe.set(key, entry_id)
                pipe.incrby(_counted_key(bus, stream), entries)
                pipe.execute()
                return True
            except redis.WatchError:
                continue


# -------------------------------------------------------------------------------------------- write
@dataclass(frozen=True)
class ArchivePart:
    """One Parquet file of one stream, holding the entries first_id..last_id (both included)."""

    stream: StreamName
    path: str
    first_id: str
    last_id: str
    entries: int | None = None
    """How many entries it holds; known to the writer that just wrote it, None when listed."""

    @property
    def first(self) -> EntryKey:
        return parse_id(self.first_id)

    @property
    def last(self) -> EntryKey:
        return parse_id(self.last_id)


RawEntry = tuple[bytes | str, dict]
"""An entry as redis-py returns it from XRANGE: (entry id, {field: value})."""


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
        ids = [_text(entry_id) for entry_id, _ in entries]
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
            raise ValueError(f"bus of run {bus.keys.run_id!r} given to the archive writer of run {self.run_id!r}")
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
        entry_hour = hour_of(parse_id(_text(entry[0]))[0])
        if chunk and entry_hour != hour:
            yield chunk
            chunk = []
        chunk.append(entry)
        hour = entry_hour
    if chunk:
        yield chunk


# --------------------------------------------------------------------------------------------- read
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
            if storage.fs.get_file_info(storage.path(info.base_name, "archive")).type == pafs.FileType.Directory:
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
        infos = self.storage.fs.get_file_info(pafs.FileSelector(self.root, recursive=True, allow_not_found=True))
        out: dict[StreamName, list[ArchivePart]] = {}
        prefix = self.root.rstrip("/") + "/"
        for info in infos:
            if info.type != pafs.FileType.File or _TEMP_NAME.search(info.base_name):
                continue  # a write interrupted before its rename: never part of the archive
            relative = info.path[len(prefix):].split("/")
            match = _PART_NAME.match(info.base_name)
            if len(relative) != 3 or relative[0] not in STREAMS or not match:
                raise ArchiveError(f"{info.path}: not an archive part (expected "
                                   f"<stream>/<YYYYMMDD-HH>/part-<first id>-<last id>.parquet under {self.root})")
            stream, hour, _ = relative
            part = ArchivePart(stream, info.path, match[1], match[2])
            if part.first > part.last or hour_of(part.first[0]) != hour:
                raise ArchiveError(f"{info.path}: its name does not fit its place (ids {part.first_id}..{part.last_id} "
                                   f"under hour {hour})")
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
        _check_stream(stream)
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
            _check_stream(stream)
        bound = parse_id(after) if after else None
        iterators = [self._stream_entries([p for p in found.get(stream, []) if bound is None or p.last > bound], bound)
                     for stream in wanted]
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
                entry.envelope
                counts[stream] += 1
        return counts

    def _stream_entries(self, parts: list[ArchivePart], after: EntryKey | None = None) -> Iterator[ArchivedEntry]:
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
                   if field.name not in table.schema.names or table.schema.field(field.name).type != field.type]
        if missing:
            raise ArchiveError(f"{part.path}: missing or mistyped columns: {', '.join(missing)}")
        columns = {name: table.column(name).to_pylist() for name in SCHEMA.names}
        out = []
        previous: EntryKey | None = None
        for i, entry_id in enumerate(columns["entry_id"]):
            key = (columns["ms"][i], columns["seq"][i])
            if entry_id is None or parse_id(entry_id) != key:
                raise ArchiveError(f"{part.path} entry {entry_id}: id does not match its ms/seq columns {key}")
            if previous is not None and key <= previous:
                raise ArchiveError(f"{part.path} entry {entry_id}: out of order after {format_id(previous)}")
            previous = key
            out.append(ArchivedEntry(part.stream, entry_id, key[0], key[1], columns["type"][i], columns["v"][i],
                                     columns["body"][i], dict(columns["extra"][i] or ()), part.path))
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


def _check_stream(stream: str) -> None:
    if stream not in STREAMS:
        raise ValueError(f"unknown stream {stream!r}; streams are {', '.join(STREAMS)}")


# ------------------------------------------------------------------------------------------ history
class StreamHistory:
    """Every entry a stream of a run has had, oldest first, whether the recorder trimmed it from Redis
    (then it is read from the archive) or not; `new_entries()` returns what came since its last call.

    The live stream is read first, the archive after: the recorder trims only what it has archived,
    so whatever is older than the first live entry is in the archive by then. The archive is only
    consulted when the stream has lost entries past the cursor (XINFO STREAM: entries-added above its
    length, first entry after the cursor).
    """

    def __init__(self, bus: Bus, stream: StreamName, reader: ArchiveReader | None) -> None:
        _check_stream(stream)
        self.bus = bus
        self.stream = stream
        self.reader = reader
        self.cursor: str | None = None

    def new_entries(self, count: int | None = None) -> list[RawEntry]:
        key = self.bus.keys.stream(self.stream)
        try:
            info = self.bus.redis.xinfo_stream(key)
        except redis.ResponseError:  # no such stream (yet, or any more): the archive alone
            info = None
        live = [(_text(entry_id), fields) for entry_id, fields in
                self.bus.redis.xrange(key, min=f"({self.cursor}" if self.cursor else "-", count=count)]
        # Trimming removes the oldest entries: some after the cursor are gone only if the stream lost
        # entries at all and its first entry is now past the cursor.
        trimmed_after_cursor = info is None or (
            int(info["entries-added"]) > int(info["length"])
            and (self.cursor is None or not info["first-entry"]
                 or parse_id(_text(info["first-entry"][0])) > parse_id(self.cursor)))
        older: list[RawEntry] = []
        if self.reader is not None and trimmed_after_cursor:
            first_live = parse_id(live[0][0]) if live else None
            for entry in self.reader.entries(self.stream, after=self.cursor):
                if first_live is not None and entry.key >= first_live:
                    break
                older.append((entry.entry_id, entry.fields))
                if count is not None and len(older) >= count:
                    break
        entries = (older + live)[:count] if count is not None else older + live
        if entries:
            self.cursor = entries[-1][0]
        return entries

    def new_events(self) -> list[Delivery]:
        """new_entries(), decoded; entries that are no event (a malformed one, dead-lettered by the
        services) are left out."""
        out = []
        for entry_id, fields in self.new_entries():
            try:
                out.append(Delivery(self.stream, entry_id, decode(fields)))
            except EventDecodeError:
                continue
        return out


def stream_history(bus: Bus, stream: StreamName, storage_uri: str | None) -> list[RawEntry]:
    """A stream's whole history: archived entries, then live ones (see StreamHistory)."""
    reader = ArchiveReader(storage_uri, bus.keys.run_id) if storage_uri else None
    return StreamHistory(bus, stream, reader).new_entries()


def read_history(bus: Bus, stream: StreamName, storage_uri: str | None) -> list[Delivery]:
    """Every event a stream has had, decoded (entries that are no event left out): what `Bus.read_all`
    gives for a stream nothing trimmed, for a recorded run."""
    reader = ArchiveReader(storage_uri, bus.keys.run_id) if storage_uri else None
    return StreamHistory(bus, stream, reader).new_events()


# --------------------------------------------------------------------------------------------- trim
UNCONSUMED_STREAMS: tuple[StreamName, ...] = ("rewards", "policy")
"""Streams that no service reads through a consumer group (people, the archive and Bus.last read them): with
no group to wait for, they are trimmed as soon as they are archived, or Redis would grow by an entry per
rollout for the whole run."""


def trim_safe_id(bus: Bus, stream: StreamName, require_archived: bool = True) -> str | None:
    """The highest entry id that may be trimmed, with every entry before it; None: nothing may.

    An entry may go once every consumer group of the stream has had it delivered and acknowledged,
    and, with `require_archived` (recording on), once it is archived. A stream with no group keeps
    everything, except the streams that no consumer group ever reads (UNCONSUMED_STREAMS), which are
    trimmed behind the archive alone (with recording on). The newest entry that decodes always stays,
    with everything after it: `Bus.last` reads current state from it (the policy version a restarted
    dispatcher or trainer resumes from).

    A group created after this returns finds the stream as if it had been created after the trim:
    it never had a claim on what was cut.
    """
    key = bus.keys.stream(stream)
    try:
        groups = bus.redis.xinfo_groups(key)
    except redis.ResponseError:  # no such stream
        return None
    if not groups and not (require_archived and stream in UNCONSUMED_STREAMS):
        return None
    # Keep the newest entry that decodes (and what follows it), not only the newest: Bus.last reads it,
    # and a malformed entry after it must not make the current state disappear.
    newest_event = bus.last(stream)
    if newest_event is None:
        return None
    before = bus.redis.xrevrange(key, max=f"({newest_event.entry_id}", count=1)
    if not before:
        return None
    bounds = [parse_id(_text(before[0][0]))]
    if require_archived:
        archived = archived_id(bus, stream)
        if archived is None:
            return None
        bounds.append(parse_id(archived))
    for info in groups:
        if int(info["pending"]):
            summary = bus.redis.xpending(key, info["name"])
            if summary["pending"]:
                # Everything strictly older than the group's oldest pending entry has been acked.
                before = bus.redis.xrevrange(key, max=f"({_text(summary['min'])}", min="-", count=1)
                if not before:
                    return None
                bounds.append(parse_id(_text(before[0][0])))
                continue
        bounds.append(parse_id(_text(info["last-delivered-id"])))
    bound = min(bounds)
    return None if bound == (0, 0) else format_id(bound)


def trim_stream(bus: Bus, stream: StreamName, require_archived: bool = True) -> int:
    """Trim the entries up to trim_safe_id; returns how many were removed."""
    safe = trim_safe_id(bus, stream, require_archived)
    if safe is None:
        return 0
    # MINID keeps ids >= its argument. Exact trimming ("=" rather than "~"): the bound is the point.
    return int(bus.redis.xtrim(bus.keys.stream(stream), minid=next_id(safe), approximate=False))
