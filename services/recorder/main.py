"""Recorder: archives every stream of the run to Parquet in run storage, then trims behind consumers.

Every flush interval, and at once for a stream that grew by a part's worth of entries, it reads each
stream with XRANGE after its archived position (no consumer group: it takes no entry away from anyone),
writes parts under <storage>/<run>/archive/ (archive_writer.py; layout in
shared/contract/archive/layout.py), advances the position after each part exists, and then trims the
stream behind the slowest consumer group and the archive. A crash at any point loses nothing: at worst
one part is written twice, and readers return each entry once. SIGTERM drains: a last flush, then exit.

    rollstream-recorder          # configured by RS_* variables or RS_CONFIG_FILE (recorder.*)
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import redis
from prometheus_client import Counter

from rollstream.services.recorder.archive_writer import ArchiveWriter, count_lost, counted_entries
from rollstream.shared.contract.archive import ArchivePart, archived_id, as_text, parse_id, trim_stream
from rollstream.shared.contract.bus import STREAMS, Bus, StreamName
from rollstream.shared.runtime.config import RecorderSettings, Settings
from rollstream.shared.runtime.service import ServiceRuntime
from rollstream.shared.runtime.storage import Storage

ENTRIES = Counter("rollstream_recorder_entries_total",
                  "Stream entries the recorder archived, trimmed behind the slowest group, or found deleted "
                  "before it archived them (lost).", ["stream", "outcome"])
PART_ENTRIES = RecorderSettings().part_entries
POLL_S = 0.5
"""How often the loop looks for a stream that has grown by a part's worth of entries."""


@dataclass
class Recorded:
    """What one flush did to one stream."""

    archived: int = 0
    parts: list[ArchivePart] = field(default_factory=list)
    trimmed: int = 0
    lost: int = 0
    """Entries deleted from the stream before they were archived (trimmed by someone else)."""


def record_once(bus: Bus, writer: ArchiveWriter, *, part_entries: int = PART_ENTRIES, trim: bool = True,
                streams: Iterable[StreamName] = STREAMS) -> dict[StreamName, Recorded]:
    """Archive every stream up to its newest entry as of now, then trim it; streams that do not exist
    yet are left out of the result."""
    out: dict[StreamName, Recorded] = {}
    for stream in streams:
        try:
            info = bus.redis.xinfo_stream(bus.keys.stream(stream))
        except redis.ResponseError:
            continue
        recorded = out[stream] = Recorded()
        # Stop at the newest entry as of the start, so a producer faster than us cannot keep a drain
        # going, and so that the stream's entries-added counter describes exactly what we read.
        target = as_text(info["last-generated-id"])
        position = archived_id(bus, stream)
        while position is None or parse_id(position) < parse_id(target):
            parts = writer.archive_new(bus, stream, part_entries, until=target)
            if not parts:
                break
            recorded.parts.extend(parts)
            recorded.archived += sum(part.entries or 0 for part in parts)
            position = parts[-1].last_id
        # Our own trims never pass the archived position: entries added but neither archived nor
        # counted before were deleted by someone else first (XTRIM MAXLEN, XDEL).
        lost = int(info["entries-added"]) - counted_entries(bus, stream)
        if lost > 0:
            count_lost(bus, stream, lost)
            recorded.lost = lost
        if trim:
            recorded.trimmed = trim_stream(bus, stream, require_archived=True)
    return out


class Recorder:
    """Totals across flushes, and which streams have grown enough to flush before the interval."""

    def __init__(self, bus: Bus, writer: ArchiveWriter, part_entries: int = PART_ENTRIES,
                 trim: bool = True) -> None:
        self.bus = bus
        self.writer = writer
        self.part_entries = part_entries
        self.trim = trim
        self.archived = {stream: 0 for stream in STREAMS}
        self.trimmed = {stream: 0 for stream in STREAMS}
        self.parts = 0
        self.flushes = 0
        self.lost = {stream: 0 for stream in STREAMS}
        self.length_after_flush: dict[StreamName, int] = {}

    def flush(self, streams: Iterable[StreamName] = STREAMS) -> dict[StreamName, Recorded]:
        results = record_once(self.bus, self.writer, part_entries=self.part_entries, trim=self.trim,
                              streams=streams)
        for stream, recorded in results.items():
            self.archived[stream] += recorded.archived
            self.trimmed[stream] += recorded.trimmed
            self.parts += len(recorded.parts)
            self.lost[stream] += recorded.lost
            ENTRIES.labels(stream, "archived").inc(recorded.archived)
            ENTRIES.labels(stream, "trimmed").inc(recorded.trimmed)
            ENTRIES.labels(stream, "lost").inc(recorded.lost)
        self.length_after_flush.update(zip(results, self._lengths(results)))
        self.flushes += 1
        return results

    def backlogged(self) -> list[StreamName]:
        """Streams that grew by part_entries or more since their last flush. XLEN is a cheap measure
        because only the recorder trims."""
        return [stream for stream, length in zip(STREAMS, self._lengths(STREAMS))
                if length - self.length_after_flush.get(stream, 0) >= self.part_entries]

    def _lengths(self, streams: Iterable[StreamName]) -> list[int]:
        pipe = self.bus.redis.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(self.bus.keys.stream(stream))
        return [int(n) for n in pipe.execute()]

    def status(self) -> dict:
        return {"archived": dict(self.archived), "trimmed": dict(self.trimmed), "parts": self.parts,
                "flushes": self.flushes, "archived_to": {s: archived_id(self.bus, s) for s in STREAMS},
                "lost_before_archive": {s: n for s, n in self.lost.items() if n}}


def main() -> None:
    settings = Settings()
    flush_s, part_entries, trim = (settings.recorder.flush_s, settings.recorder.part_entries,
                                   settings.recorder.trim)
    runtime = ServiceRuntime("recorder", settings)
    bus = Bus.connect(settings.redis, settings.run_id, settings.bus)
    storage = Storage(settings.storage_uri)
    recorder = Recorder(bus, ArchiveWriter(storage, settings.run_id), part_entries, trim)
    runtime.log.info("recording", extra={"archive": storage.path(settings.run_id, "archive"),
                                         "flush_s": flush_s, "part_entries": part_entries, "trim": trim})

    def flush(streams: Iterable[StreamName]) -> None:
        results = recorder.flush(streams)
        for stream, recorded in results.items():
            if recorded.lost:
                runtime.log.error("entries were deleted from the stream before they were archived",
                                  extra={"stream": stream, "lost": recorded.lost,
                                         "archived_to": archived_id(bus, stream)})
        written = {stream: r.archived for stream, r in results.items() if r.archived or r.trimmed}
        if written:
            trimmed = {s: r.trimmed for s, r in results.items() if r.trimmed}
            runtime.log.info("flushed", extra={"archived": written, "trimmed": trimmed})
        runtime.status.update(recorder.status())

    next_flush = time.monotonic()
    while not runtime.should_stop():
        if time.monotonic() >= next_flush:
            flush(STREAMS)
            next_flush = time.monotonic() + flush_s
        elif backlogged := recorder.backlogged():
            flush(backlogged)
        time.sleep(min(POLL_S, flush_s))

    flush(STREAMS)  # drain: what arrived since the last flush is archived before exit
    runtime.close()


if __name__ == "__main__":
    main()
