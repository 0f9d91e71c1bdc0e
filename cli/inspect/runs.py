"""Tables of what runs hold: every run with its entries per stream, and one run's streams in detail.

    rollstream inspect runs            # every run in Redis and in storage, entries per stream
    rollstream inspect streams RUN     # per stream: length, ids, archive position, groups' lag

`collect_runs` and `collect_streams` gather the numbers; `runs_table` and `streams_table` render them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from rich.table import Table

from rollstream.cli.inspect.connections import (
    RunSource,
    _archive_runs,
    _text,
    _where,
    archive_count,
    redis_runs,
)
from rollstream.shared.contract.archive import ArchiveReader, archived_id
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.contract.events import EventDecodeError, PolicyUpdated, decode


# --------------------------------------------------------------------------------------------- runs
@dataclass
class RunSummary:
    run: str
    in_redis: bool
    in_archive: bool
    entries: dict[str, int]
    """Entries ever added per stream: XINFO STREAM entries-added when live, else the archive's count."""
    policy_version: int | None

    @property
    def where(self) -> str:
        return _where(self.in_redis, self.in_archive)


def latest_policy_version(bus: Bus | None, reader: ArchiveReader | None) -> int | None:
    if bus is not None:
        try:
            newest = bus.redis.xrevrange(bus.keys.stream("policy"), count=10)
        except redis.ResponseError:  # not a stream (another program's key)
            newest = []
        for _, fields in newest:
            try:
                event = decode(fields).payload
            except EventDecodeError:
                continue
            if isinstance(event, PolicyUpdated):
                return event.version
    if reader is not None and "policy" in reader.streams():
        version = None
        for entry in reader.entries("policy"):
            try:
                event = entry.envelope.payload
            except Exception:
                continue
            if isinstance(event, PolicyUpdated):
                version = event.version
        return version
    return None


def summarize_run(client: redis.Redis | None, storage_uri: str, run: str, in_redis: bool, in_archive: bool) -> RunSummary:
    bus = Bus(client, run) if in_redis and client is not None else None
    reader = ArchiveReader(storage_uri, run) if in_archive else None
    archived_streams = set(reader.streams()) if reader is not None else set()
    entries: dict[str, int] = {}
    for stream in STREAMS:
        count = None
        if bus is not None:
            try:
                info = bus.redis.xinfo_stream(bus.keys.stream(stream))
                count = int(info.get("entries-added", info["length"]))
            except redis.ResponseError:
                count = None
        if count is None and stream in archived_streams:
            count = archive_count(reader, stream)
        entries[stream] = count or 0
    return RunSummary(run, in_redis, in_archive, entries, latest_policy_version(bus, reader))


def collect_runs(client: redis.Redis | None, storage_uri: str) -> list[RunSummary]:
    """Every run in Redis or with an archive in storage, sorted by name."""
    live = set(redis_runs(client))
    archived = set(_archive_runs(storage_uri))
    return [summarize_run(client, storage_uri, run, run in live, run in archived) for run in sorted(live | archived)]


def runs_table(summaries: list[RunSummary], storage_uri: str = "") -> Table:
    table = Table(title=f"runs ({len(summaries)})" + (f", storage {storage_uri}" if storage_uri else ""))
    table.add_column("run", no_wrap=True)
    table.add_column("where")
    for stream in STREAMS:
        table.add_column(stream, justify="right")
    table.add_column("latest version", justify="right")
    for s in summaries:
        table.add_row(s.run, s.where, *(str(s.entries[stream]) for stream in STREAMS),
                      "-" if s.policy_version is None else f"v{s.policy_version}")
    table.caption = "entries ever added per stream (XINFO STREAM entries-added when live, else the archive's count)"
    return table


# ------------------------------------------------------------------------------------------ streams
@dataclass
class GroupState:
    name: str
    consumers: int
    lag: int | None
    """Entries not yet delivered to the group."""
    lag_source: str
    """`redis` (XINFO GROUPS lag) or `computed` (Bus.group_lag: Redis could not tell)."""
    pending: int
    """Delivered, not acknowledged."""
    last_delivered: str


@dataclass
class StreamState:
    stream: str
    live: bool
    length: int | None
    added: int | None
    first_id: str | None
    last_id: str | None
    archived_to: str | None
    archived_entries: int | None
    groups: list[GroupState] = field(default_factory=list)


def collect_streams(source: RunSource) -> list[StreamState]:
    bus, reader = source.bus, source.reader
    archived_streams = set(reader.streams()) if reader is not None else set()
    out = []
    for stream in STREAMS:
        state = StreamState(stream, False, None, None, None, None, None,
                            archive_count(reader, stream) if stream in archived_streams else None)
        if bus is not None:
            state.archived_to = archived_id(bus, stream)
            key = bus.keys.stream(stream)
            try:
                info = bus.redis.xinfo_stream(key)
            except redis.ResponseError:
                info = None
            if info is not None:
                state.live = True
                state.length = int(info["length"])
                state.added = int(info["entries-added"]) if info.get("entries-added") is not None else None
                first, last = info.get("first-entry"), info.get("last-entry")
                state.first_id = _text(first[0]) if first else None
                state.last_id = _text(last[0]) if last else None
                try:
                    groups = bus.redis.xinfo_groups(key)
                except redis.ResponseError:  # deleted since
                    groups = []
                for group in groups:
                    name = _text(group["name"])
                    lag, lag_source = group.get("lag"), "redis"
                    if lag is None:
                        lag, lag_source = bus.group_lag(stream, name)[0], "computed"
                    state.groups.append(GroupState(name, int(group["consumers"]), int(lag), lag_source,
                                                   int(group["pending"]), _text(group["last-delivered-id"])))
        out.append(state)
    return out


def streams_table(run: str, states: list[StreamState], where: str = "") -> Table:
    table = Table(title=f"run {run}: streams" + (f" ({where})" if where else ""))
    for column, justify in (("stream", "left"), ("length", "right"), ("added", "right"), ("first id", "left"),
                            ("last id", "left"), ("archived to", "left"), ("archived", "right"), ("group", "left"),
                            ("consumers", "right"), ("lag", "right"), ("pending", "right")):
        table.add_column(column, justify=justify, no_wrap=True)

    def show(value) -> str:
        return "-" if value is None else str(value)

    for state in states:
        stream_cells = [state.stream, show(state.length), show(state.added), show(state.first_id),
                        show(state.last_id), show(state.archived_to), show(state.archived_entries)]
        if not state.live:
            stream_cells[1] = "not live"
        if not state.groups:
            table.add_row(*stream_cells, "-", "", "", "")
        for i, group in enumerate(state.groups):
            lag = str(group.lag) + ("*" if group.lag_source == "computed" else "")
            cells = stream_cells if i == 0 else [""] * len(stream_cells)
            table.add_row(*cells, group.name, str(group.consumers), lag, str(group.pending))
        table.add_section()
    table.caption = ("lag: entries not yet delivered to the group (* counted after its last-delivered id: Redis "
                     "could not tell); pending: delivered, not acknowledged; archived: entries in the archive")
    return table
