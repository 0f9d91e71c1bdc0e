"""The recorder's settings (`recorder.*`, RS_RECORDER__*): whether every stream is archived to Parquet, how
often, and whether the live streams are trimmed behind the archive.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from pydantic import Field

from rollstream.shared.runtime.sections import Section


class RecorderSettings(Section):
    enabled: bool = True
    """Archive every stream of the run to Parquet under <storage>/<run>/archive (the local run starts the
    recorder service)."""
    flush_s: float = Field(5.0, gt=0)
    """Seconds between flushes of every stream to the archive."""
    part_entries: int = Field(2000, ge=1)
    """Most entries per Parquet part; a stream this far behind is flushed at once."""
    trim: bool = True
    """Trim live streams behind the archive and the slowest consumer group (Redis memory stays bounded)."""
