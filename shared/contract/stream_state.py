"""What Redis says of a run's streams now: per stream its length, entries added, first and last ids and
archived position; per consumer group its lag and pending entries; per consumer its pending entries and idle
time. `rollstream inspect streams` prints it, the console serves it.

    python -m pytest tests/unit/cli/test_inspect.py tests/unit/services/console -q
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from rollstream.shared.contract.archive import archived_id
from rollstream.shared.contract.bus import STREAMS, Bus
from rollstream.shared.contract.run_source import RunSource, archive_count, as_text


@dataclass
class ConsumerState:
    name: str
    """The consumer's name: `<service>-<host>-<pid>` (bus.consumer_name), one per replica process."""
    pending: int
    """Entries delivered to it and not acknowledged."""
    idle_ms: int
    """Since its last read or claim."""


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
    members: list[ConsumerState] = field(default_factory=list)


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


def collect_streams(source: RunSource, count_archive: bool = True) -> list[StreamState]:
    """Every stream of the run; count_archive: read the archive's entry ids to count them (archived_entries),
    which takes a read of every part."""
    bus, reader = source.bus, source.reader
    archived_streams = set(reader.streams()) if reader is not None and count_archive else set()
    out = []
    for stream in STREAMS:
        state = StreamState(stream, False, None, None, None, None, None,
                            archive_count(reader, stream) if stream in archived_streams else None)
        if bus is not None:
            state.archived_to = archived_id(bus, stream)
            _read_live(bus, stream, state)
        out.append(state)
    return out


def _read_live(bus: Bus, stream: str, state: StreamState) -> None:
    key = bus.keys.stream(stream)
    try:
        info = bus.redis.xinfo_stream(key)
    except redis.ResponseError:
        return
    state.live = True
    state.length = int(info["length"])
    state.added = int(info["entries-added"]) if info.get("entries-added") is not None else None
    first, last = info.get("first-entry"), info.get("last-entry")
    state.first_id = as_text(first[0]) if first else None
    state.last_id = as_text(last[0]) if last else None
    try:
        groups = bus.redis.xinfo_groups(key)
    except redis.ResponseError:  # deleted since
        groups = []
    for group in groups:
        name = as_text(group["name"])
        lag, lag_source = group.get("lag"), "redis"
        if lag is None:
            lag, lag_source = bus.group_lag(stream, name)[0], "computed"
        state.groups.append(GroupState(name, int(group["consumers"]), int(lag), lag_source,
                                       int(group["pending"]), as_text(group["last-delivered-id"]),
                                       _consumers(bus, key, name)))


def _consumers(bus: Bus, key: str, group: str) -> list[ConsumerState]:
    try:
        found = bus.redis.xinfo_consumers(key, group)
    except redis.ResponseError:  # the group went away since
        return []
    return [ConsumerState(as_text(c["name"]), int(c["pending"]), int(c["idle"])) for c in found]
