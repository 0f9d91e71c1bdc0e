"""What a stream archive is on disk: where its parts are, the Parquet schema they hold, entry ids.

    <storage>/<run>/archive/<stream>/<YYYYMMDD-HH>/part-<first entry id>-<last entry id>.parquet

The hour is the UTC hour of the first entry id's millisecond time; a part never spans two hours. A
part holds the entries as they were on the stream: the Redis entry id, its time and sequence, the
`type` and `v` fields, the msgpack `body` bytes untouched, and every other field in `extra`, so
that nothing an entry carried is lost (a malformed entry is archived as faithfully as a good one).

    python -m pytest tests/unit/shared/contract/test_archive.py -q
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa

from rollstream.shared.contract.bus import StreamName

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

PART_NAME = re.compile(r"^part-(\d+-\d+)-(\d+-\d+)\.parquet$")
"""A part's file name: the first and the last entry id it holds."""
_MAX_SEQ = 2**64 - 1

EntryKey = tuple[int, int]
"""An entry id as (ms, seq), ordered as Redis orders ids."""


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
    return datetime.fromtimestamp(ms // 1000, UTC).strftime("%Y%m%d-%H")


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
