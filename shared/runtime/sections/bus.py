"""The bus's settings (`bus.*`, RS_BUS__*): how the stream bus (shared/contract/bus.py) delivers, reclaims and
dead-letters, and the Redis it and the job queues run on.

    python -m pytest tests/unit/shared/runtime/test_config.py -q
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from rollstream.shared.runtime.sections import Section


class BusSettings(Section):
    max_deliveries: int = Field(5, ge=1)
    """Deliveries of one entry before it goes to the run's dead-letter stream."""
    reclaim_idle_ms: int = Field(30_000, ge=100)
    """An entry pending this long on a consumer is taken over by a live one (XAUTOCLAIM)."""
    block_ms: int = Field(500, ge=1)
    """How long one read waits for new entries."""
    read_count: int = Field(64, ge=1)
    """Entries fetched per read."""
    cluster: bool = False
    """The Redis URL names a node of a Redis Cluster: the client finds the others and routes each command to
    the node holding its key (every key of a run is in one hash slot: `rs:{<run_id>}:...`)."""
    job_queue_url: str | None = None
    """A Redis of its own for the sandbox-grader's job queue (RQ), redis://host:port/db with no credentials
    (the bus's user and password are used there too): RQ does not run on a Redis Cluster, so a run on one
    needs it. None: the bus's Redis."""

    @field_validator("job_queue_url")
    @classmethod
    def _no_credentials(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("redis", "rediss", "unix") or parts.username or parts.password:
                raise ValueError("bus.job_queue_url is a redis:// URL without credentials (the bus's are "
                                 "used)")
        return url
