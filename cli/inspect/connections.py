"""Which Redis and storage every `rollstream inspect` command (runs, streams, trajectory, diff) reads: the
options', else the settings', else the defaults. No Redis answering is a warning, not an error: inspection
goes on from the archives. Where a run is read from is shared/contract/run_source.py.
"""

from __future__ import annotations

from pathlib import Path

import redis
from rich.console import Console

from rollstream.shared.runtime.config import redact_url

err_console = Console(stderr=True)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _settings():
    try:
        from rollstream.shared.runtime.config import Settings

        return Settings()
    except Exception:  # a broken RS_* environment must not stop inspection
        return None


def default_redis_url() -> str:
    settings = _settings()
    return (settings.redis if settings is not None and settings.redis_url else None) or DEFAULT_REDIS_URL


def default_storage() -> str:
    settings = _settings()
    return settings.storage_uri if settings is not None else "runs"


def default_model() -> Path | None:
    """The settings' model, whose tokenizer decodes a run's tokens when the run names none."""
    settings = _settings()
    return Path(settings.model.path) if settings is not None else None


def connect(url: str) -> redis.Redis | None:
    """A client, or None (with a warning) when no Redis answers there: inspection goes on from archives."""
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        err_console.print(f"[yellow]no Redis at {redact_url(url)} ({exc}): reading archives only[/]")
        return None
    return client
