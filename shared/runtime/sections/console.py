"""The console's settings (`console.*`, RS_CONSOLE__*): where its page and JSON API listen, and the health
APIs of the services it shows.

    python -m pytest tests/unit/shared/runtime/test_config.py tests/unit/services/console -q
"""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import Field, field_validator

from rollstream.shared.runtime.sections import Section


class ConsoleSettings(Section):
    port: int = Field(8400, ge=0, le=65535)
    """Port of the console's page and JSON API (rollstream-console), on listen_host; 0: any free port (the
    console logs the one it took)."""
    health_urls: dict[str, str] = {}
    """Service name -> the base URL of its health API, e.g. {"dispatcher": "http://dispatcher:8080"}: the
    console shows each one's /healthz, asked at every address the host name has (a compose service's
    replicas). Without them the console shows what Redis knows: consumer groups, their consumers, idle
    times."""

    @field_validator("health_urls")
    @classmethod
    def _base_urls(cls, urls: dict[str, str]) -> dict[str, str]:
        for name, url in urls.items():
            parts = urlsplit(url)
            if not name or parts.scheme not in ("http", "https") or not parts.hostname \
                    or parts.path not in ("", "/") or parts.query or parts.username:
                raise ValueError(f"console.health_urls[{name!r}] = {url!r}: give a service's name and the "
                                 "base URL of its health API, http://host:port, without a path or "
                                 "credentials")
        return urls
