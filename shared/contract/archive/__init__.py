"""Stream archives: a run's raw stream entries kept as Parquet in run storage, and read back.

    <storage>/<run>/archive/<stream>/<YYYYMMDD-HH>/part-<first entry id>-<last entry id>.parquet

The recorder writes the parts and advances each stream's archived position
(services/recorder/archive_writer.py); this package is what everyone else needs of them:

    layout.py     where parts are, the Parquet schema they hold, entry ids
    position.py   the archived position of a stream, kept in Redis
    reader.py     ArchiveReader: every entry once, in entry-id order, however often a part was written
    history.py    StreamHistory, read_history: a stream's whole history, archived and live
    trim.py       trim_stream: behind the slowest consumer group and the archived position

    reader = ArchiveReader("runs", "run1")
    reader.validate()                       # every part readable, every entry decodes
    for entry in reader.entries():          # all streams, merged in entry-id order
        entry.entry_id, entry.stream, entry.envelope

    python -m pytest tests/unit/shared/contract/test_archive.py -q
"""

from rollstream.shared.contract.archive.history import StreamHistory, read_history
from rollstream.shared.contract.archive.layout import (
    FORMAT_VERSION,
    SCHEMA,
    ArchivePart,
    RawEntry,
    as_text,
    hour_of,
    parse_id,
)
from rollstream.shared.contract.archive.position import archived_id, position_key
from rollstream.shared.contract.archive.reader import ArchivedEntry, ArchiveReader, list_runs
from rollstream.shared.contract.archive.trim import UNCONSUMED_STREAMS, trim_safe_id, trim_stream

__all__ = [
    "FORMAT_VERSION", "SCHEMA", "UNCONSUMED_STREAMS", "ArchivePart", "ArchiveReader", "ArchivedEntry",
    "RawEntry", "StreamHistory", "archived_id", "as_text", "hour_of", "list_runs", "parse_id", "position_key",
    "read_history", "trim_safe_id", "trim_stream",
]
