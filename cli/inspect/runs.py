"""Tables of what runs hold: every run with its entries per stream, and one run's streams in detail.

    rollstream inspect runs            # every run in Redis and in storage, entries per stream
    rollstream inspect streams RUN     # per stream: length, ids, archive position, groups' lag

`collect_runs` gathers the runs' numbers (a run's streams: shared/contract/stream_state.py's
`collect_streams`); `runs_table` and `streams_table` render them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from rich.table import Table

from rollstream.shared.contract.archive import ArchiveReader
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.contract.events import EventDecodeError, PolicyUpdated, decode
from rollstream.shared.contract.run_source import archive_count, archive_runs, redis_runs, where_label
from rollstream.shared.contract.stream_state import StreamState


# --------------------------------------------------------------------------------------------- runs
@dataclass
class RunSummary:
    run: str
    in_redis: bool
    in_archive: bool
    entries: dict[str, int]
    """Entries ever added per stream: XINFO STREAM entries-added when live, else the archive's count."""
    policy_version: int | None
    role_versions: dict[str, int] = field(default_factory=dict)
    """Each trained role's version at the latest policy update (PolicyUpdated.role_versions)."""

    @property
    def where(self) -> str:
        return where_label(self.in_redis, self.in_archive)


def latest_policy_update(bus: Bus | None, reader: ArchiveReader | None) -> PolicyUpdated | None:
    """The run's newest PolicyUpdated: from Redis while the run is live there, else from its archive."""
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
                return event
    if reader is not None and "policy" in reader.streams():
        latest = None
        for entry in reader.entries("policy"):
            try:
                event = entry.envelope.payload
            except Exception:
                continue
            if isinstance(event, PolicyUpdated):
                latest = event
        return latest
    return None


def says_more(per_role: dict[str, float], overall: float) -> bool:
    """Whether values given per role say more than the one overall value: several roles, or one role's value
    that is not it."""
    return len(per_role) > 1 or any(value != overall for value in per_role.values())


def version_text(version: int, role_versions: dict[str, int]) -> str:
    """A policy version, with each role's where they say more ("v5 (planner v3, solver v4)")."""
    if not says_more(role_versions, version):
        return f"v{version}"
    return f"v{version} (" + ", ".join(f"{role} v{v}" for role, v in role_versions.items()) + ")"


def summarize_run(client: redis.Redis | None, storage_uri: str, run: str, in_redis: bool,
                  in_archive: bool) -> RunSummary:
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
    latest = latest_policy_update(bus, reader)
    return RunSummary(run, in_redis, in_archive, entries, latest.version if latest is not None else None,
                      dict(latest.role_versions) if latest is not None else {})


def collect_runs(client: redis.Redis | None, storage_uri: str) -> list[RunSummary]:
    """Every run in Redis or with an archive in storage, sorted by name."""
    live = set(redis_runs(client))
    archived = set(archive_runs(storage_uri))
    return [summarize_run(client, storage_uri, run, run in live, run in archived)
            for run in sorted(live | archived)]


def runs_table(summaries: list[RunSummary], storage_uri: str = "") -> Table:
    table = Table(title=f"runs ({len(summaries)})" + (f", storage {storage_uri}" if storage_uri else ""))
    table.add_column("run", no_wrap=True)
    table.add_column("where")
    for stream in STREAMS:
        table.add_column(stream, justify="right")
    table.add_column("latest version", justify="right")
    for s in summaries:
        table.add_row(s.run, s.where, *(str(s.entries[stream]) for stream in STREAMS),
                      "-" if s.policy_version is None else version_text(s.policy_version, s.role_versions))
    table.caption = ("entries ever added per stream (XINFO STREAM entries-added when live, else the "
                     "archive's count)")
    return table


# ------------------------------------------------------------------------------------------ streams
def streams_table(run: str, states: list[StreamState], where: str = "") -> Table:
    table = Table(title=f"run {run}: streams" + (f" ({where})" if where else ""))
    for column, justify in (("stream", "left"), ("length", "right"), ("added", "right"), ("first id", "left"),
                            ("last id", "left"), ("archived to", "left"), ("archived", "right"),
                            ("group", "left"), ("consumers", "right"), ("lag", "right"),
                            ("pending", "right")):
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
    table.caption = ("lag: entries not yet delivered to the group (* counted after its last-delivered id: "
                     "Redis could not tell); pending: delivered, not acknowledged; archived: entries in the "
                     "archive")
    return table
