"""Replay: re-publish a recorded run's stream entries into a fresh run namespace.

The source is a run's archive in storage (`ArchiveReader`), or a run still in Redis, whose trimmed
part is then read from its archive (`StreamHistory`). A replay takes all streams or a chosen subset,
optionally only the entries of rollouts that finished, and publishes each entry's fields byte for
byte, in the original order across streams, at the original pace, scaled, or as fast as possible.

Nothing is written to the target before the whole selection has been read and decoded once: a
damaged archive (unreadable part, unknown event type or schema version) fails with the part and
the entry named, and the target namespace stays empty. The `dead` stream is the exception: it holds
what the source's services could not handle, entries that do not decode among them (junk written
straight onto it, which its consumer dead-lettered in turn); those are carried over as they are, and
counted (`undecodable_dead`).

    plan = ReplayPlan(source, streams=("trajectories", "grades"), finished_only=True)
    counts = plan.validate()                      # reads everything once; ReplayError if damaged
    publish(plan, target_bus, pace=Pace.parse("fast"))
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from rollstream.shared.contract.archive import ArchiveReader, RawEntry, StreamHistory, parse_id
from rollstream.shared.contract.bus import STREAMS, Bus, StreamName
from rollstream.shared.contract.events import (
    DeadLettered,
    Envelope,
    EventDecodeError,
    TrajectoryFinished,
    decode,
)
from rollstream.shared.errors import ArchiveError, RollstreamError
from rollstream.shared.runtime.storage import Storage

DEFAULT_STREAMS: tuple[StreamName, ...] = tuple(s for s in STREAMS if s != "dead")
"""A replay leaves out dead letters by default: they are the original services' failures."""


class ReplayError(RollstreamError):
    """The source cannot be replayed (damaged, missing, or the target is not fresh); nothing was written."""


@dataclass(frozen=True)
class SourceEntry:
    stream: StreamName
    entry_id: str
    fields: dict
    origin: str
    """Where it was read from (an archive part, or the Redis stream key), for error messages."""

    @property
    def ms(self) -> int:
        return parse_id(self.entry_id)[0]

    def envelope(self) -> Envelope | None:
        """The entry's event; None for an entry of `dead` that does not decode (carried over as it is),
        ReplayError for one of any other stream (damage)."""
        try:
            return decode(self.fields)
        except EventDecodeError as exc:
            if self.stream == "dead":
                return None
            raise ReplayError(f"{self.origin} entry {self.entry_id}: {exc}") from exc


@dataclass(frozen=True)
class Pace:
    """`fast`: no waiting; `original`: the recorded gaps between entries; a number: that many times faster."""

    speed: float | None

    @classmethod
    def parse(cls, text: str) -> Pace:
        if text == "fast":
            return cls(None)
        if text == "original":
            return cls(1.0)
        try:
            speed = float(text.removesuffix("x"))
        except ValueError:
            speed = 0.0
        if not speed > 0:
            raise ValueError(f"pace {text!r}: use fast, original, or a speed-up factor such as 10 or 10x")
        return cls(speed)

    def due_s(self, first_ms: int, entry_ms: int) -> float:
        """Seconds after the replay's start at which an entry recorded at entry_ms is published."""
        if self.speed is None:
            return 0.0
        return (entry_ms - first_ms) / 1000.0 / self.speed


@dataclass
class ReplayPlan:
    """What to replay from one source run."""

    source_run: str
    storage_uri: str
    source_bus: Bus | None = None
    """The source run's Redis; None: the archive alone."""
    streams: tuple[StreamName, ...] = DEFAULT_STREAMS
    finished_only: bool = False
    """Only the entries of rollouts that have a TrajectoryFinished (plus entries that belong to no
    rollout)."""
    skip_dead_lettered: bool = False
    """Leave out the entries the source run's services dead-lettered (they would fail again, or fail the
    validation: an unknown schema version there is the source's own bad input, not archive damage)."""
    dead_lettered: set[tuple[str, str]] = field(default_factory=set)
    """(stream, entry id) of every entry the source dead-lettered; filled by validate()."""
    finished_rollouts: set[str] = field(default_factory=set)
    last_ids: dict[StreamName, str] = field(default_factory=dict)
    """The newest entry per stream seen by validate(): a live source may grow, the replay stops there."""
    undecodable_dead: int = 0
    """Entries of `dead` that do not decode and will be replayed as they are; counted by validate()."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.streams if s not in STREAMS]
        if unknown:
            raise ValueError(f"unknown streams {', '.join(unknown)}; streams are {', '.join(STREAMS)}")
        if not self.streams:
            raise ValueError("a replay needs at least one stream")

    def _stream_entries(self, stream: StreamName) -> Iterator[SourceEntry]:
        reader = ArchiveReader(self.storage_uri, self.source_run)
        until = self.last_ids.get(stream)
        if self.source_bus is None:
            entries: Iterator = ((e.entry_id, e.fields, e.path) for e in reader.entries(stream))
        else:
            key = self.source_bus.keys.stream(stream)
            history = StreamHistory(self.source_bus, stream, reader)
            entries = ((entry_id, fields, key) for entry_id, fields in _pages(history))
        for entry_id, fields, origin in entries:
            if until is not None and parse_id(entry_id) > parse_id(until):
                return
            if (stream, entry_id) not in self.dead_lettered:
                yield SourceEntry(stream, entry_id, fields, origin)

    def entries(self) -> Iterator[SourceEntry]:
        """The selected entries of every chosen stream, merged in entry-id order (ties in stream order)."""
        order = {stream: i for i, stream in enumerate(STREAMS)}
        merged = heapq.merge(*(self._stream_entries(s) for s in self.streams),
                             key=lambda e: (*parse_id(e.entry_id), order[e.stream]))
        for entry in merged:
            if self.finished_only and not self._belongs_to_a_finished_rollout(entry):
                continue
            yield entry

    def _belongs_to_a_finished_rollout(self, entry: SourceEntry) -> bool:
        envelope = entry.envelope()
        rollout = envelope.rollout_id if envelope is not None else None
        return rollout is None or rollout in self.finished_rollouts

    def validate(self) -> dict[StreamName, int]:
        """Read and decode every entry once; ReplayError naming the file (or stream) and the entry on
        the first damage. Returns how many entries each stream will replay."""
        try:
            return self._validate()
        except ArchiveError as exc:
            raise ReplayError(str(exc)) from exc

    def _validate(self) -> dict[StreamName, int]:
        self.finished_rollouts = set()
        self.last_ids = {}
        self.dead_lettered = set()
        self.undecodable_dead = 0
        if self.skip_dead_lettered:
            for entry in self._stream_entries("dead"):
                envelope = entry.envelope()
                if envelope is not None and isinstance(envelope.payload, DeadLettered):
                    self.dead_lettered.add((envelope.payload.stream, envelope.payload.entry_id))
        counts = {stream: 0 for stream in self.streams}
        for stream in self.streams:
            last = "0-0"  # a stream empty now stays empty for this replay, whatever a live source adds
            for entry in self._stream_entries(stream):
                envelope = entry.envelope()
                last = entry.entry_id
                counts[stream] += 1
                if envelope is None:
                    self.undecodable_dead += 1
                elif isinstance(envelope.payload, TrajectoryFinished) and envelope.rollout_id:
                    self.finished_rollouts.add(envelope.rollout_id)
            self.last_ids[stream] = last
        if not any(counts.values()):
            where = (f"{self.storage_uri}/{self.source_run}/archive"
                     + (" or in Redis" if self.source_bus else ""))
            raise ReplayError(f"run {self.source_run!r} has no entries in {', '.join(self.streams)} "
                              f"({where})")
        if self.finished_only:  # which rollouts finished is known only now
            counts = {stream: 0 for stream in self.streams}
            for entry in self.entries():
                counts[entry.stream] += 1
        return counts


def _pages(history: StreamHistory) -> Iterator[RawEntry]:
    """A live run's whole stream, a page at a time (its trimmed part from the archive)."""
    while True:
        page = history.new_entries(count=1000)
        if not page:
            return
        yield from page


def check_fresh(target: Bus, storage_uri: str) -> None:
    """A replay goes into a namespace nothing has written to, so its events cannot mix with others."""
    if target.has_keys():
        raise ReplayError(f"run {target.keys.run_id!r} already has keys in Redis; replay into a new run id")
    storage = Storage(storage_uri)
    run_dir = storage.path(target.keys.run_id)
    if storage.fs.get_file_info(pafs.FileSelector(run_dir, allow_not_found=True)):
        raise ReplayError(f"{run_dir} already holds files; replay into a new run id")


def publish(plan: ReplayPlan, target: Bus, pace: Pace, *, batch: int = 256,
            sleep: Callable[[float], None] = time.sleep,
            clock: Callable[[], float] = time.monotonic) -> dict[StreamName, int]:
    """Publish the plan's entries (validate() first) into `target`, fields byte for byte, new entry ids,
    the original order across streams. Returns how many entries went to each stream."""
    if not plan.last_ids:
        raise ReplayError("validate() the plan before publishing it")
    counts = {stream: 0 for stream in plan.streams}
    started = clock()
    first_ms: int | None = None
    pipe = target.redis.pipeline(transaction=False)
    queued = 0
    for entry in plan.entries():
        first_ms = entry.ms if first_ms is None else first_ms
        wait = pace.due_s(first_ms, entry.ms) - (clock() - started)
        if wait > 0:
            if queued:
                pipe.execute()
                queued = 0
            sleep(wait)
        pipe.xadd(target.keys.stream(entry.stream), entry.fields)
        counts[entry.stream] += 1
        queued += 1
        if queued >= batch:
            pipe.execute()
            queued = 0
    if queued:
        pipe.execute()
    return counts
