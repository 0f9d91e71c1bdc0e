"""The archived position of a stream: the last entry id known to be in the archive, kept in Redis.

The recorder advances it after each part it writes (services/recorder/archive_writer.py); trimming
never passes it, and `rollstream inspect` shows it.

    python -m pytest tests/unit/shared/contract/test_archive.py tests/unit/services/recorder -q
"""

from __future__ import annotations

from rollstream.shared.contract.archive.layout import as_text
from rollstream.shared.contract.bus import Bus, StreamName


def position_key(bus: Bus, stream: StreamName) -> str:
    """Where the archived position of `stream` is kept."""
    return bus.keys.state("recorder", "archived", stream)


def archived_id(bus: Bus, stream: StreamName) -> str | None:
    """The last entry id of `stream` known to be in the archive; None before the first part."""
    value = bus.redis.get(position_key(bus, stream))
    return as_text(value) if value is not None else None
