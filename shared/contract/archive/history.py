"""A stream's whole history in a run: entries the recorder trimmed from Redis read from the archive,
the rest from the live stream.

    python -m pytest tests/unit/shared/contract/test_archive.py tests/unit/cli/test_replay.py -q
"""

from __future__ import annotations

import redis

from rollstream.shared.contract.archive.layout import RawEntry, as_text, parse_id
from rollstream.shared.contract.archive.reader import ArchiveReader, check_stream
from rollstream.shared.contract.bus import Bus, Delivery, StreamName
from rollstream.shared.contract.events import EventDecodeError, decode


class StreamHistory:
    """Every entry a stream of a run has had, oldest first, whether the recorder trimmed it from Redis
    (then it is read from the archive) or not; `new_entries()` returns what came since its last call.

    The live stream is read first, the archive after: the recorder trims only what it has archived,
    so whatever is older than the first live entry is in the archive by then. The archive is only
    consulted when the stream has lost entries past the cursor (XINFO STREAM: entries-added above its
    length, first entry after the cursor).
    """

    def __init__(self, bus: Bus, stream: StreamName, reader: ArchiveReader | None) -> None:
        check_stream(stream)
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
        live = [(as_text(entry_id), fields) for entry_id, fields in
                self.bus.redis.xrange(key, min=f"({self.cursor}" if self.cursor else "-", count=count)]
        # Trimming removes the oldest entries: some after the cursor are gone only if the stream lost
        # entries at all and its first entry is now past the cursor.
        trimmed_after_cursor = info is None or (
            int(info["entries-added"]) > int(info["length"])
            and (self.cursor is None or not info["first-entry"]
                 or parse_id(as_text(info["first-entry"][0])) > parse_id(self.cursor)))
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


def read_history(bus: Bus, stream: StreamName, storage_uri: str | None) -> list[Delivery]:
    """Every event a stream has had, decoded (entries that are no event left out): what `Bus.read_all`
    gives for a stream nothing trimmed, for a recorded run."""
    reader = ArchiveReader(storage_uri, bus.keys.run_id) if storage_uri else None
    return StreamHistory(bus, stream, reader).new_events()
