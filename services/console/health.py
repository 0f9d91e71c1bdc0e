"""The health of the run's services and replicas, as the console shows it.

Each service named in console.health_urls is asked for its /healthz at every address its host name resolves
to: a compose service scaled to N replicas has N addresses, so each replica answers for itself. The vLLM
servers of the fleet are asked for their /health, with the versions the trainer last recorded for each
(run_facts.FLEET_VERSIONS): the whole policy's under the server's URL, each LoRA adapter's (a role's) under
`<role>@<url>` (shared/contract/roles.py), shown as the server's `policy_version` and `adapter_versions`.
What no URL names is what Redis knows (shared/contract/stream_state.py): every consumer group's consumers, one
per replica process, with their pending entries and idle times.

    python -m pytest tests/unit/services/console -q
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from rollstream.shared.contract.roles import split_version_field

PROBE_TIMEOUT_S = 2.0
HEALTH_FIELDS = ("service", "status", "reason", "uptime_s")
"""What every /healthz says (shared/runtime/health_api.py); the rest of its body is the service's own
facts."""


async def replica_addresses(host: str, port: int) -> list[str]:
    """The addresses a host name resolves to (one per replica behind a compose service's name); the host
    itself when it is an address, or when it does not resolve (the probe then says so)."""
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return [host]
    return sorted({info[4][0] for info in found})


def _why(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _url_on(address: str, parts) -> str:
    shown = f"[{address}]" if ":" in address else address
    return f"{parts.scheme}://{shown}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


async def probe_service(client: httpx.AsyncClient, name: str, base_url: str) -> list[dict[str, Any]]:
    """One row per replica of a service: its /healthz's status, reason, uptime and facts, or why it did not
    answer."""
    parts = urlsplit(base_url)
    rows = []
    for address in await replica_addresses(parts.hostname, parts.port or 80):
        url = _url_on(address, parts)
        row: dict[str, Any] = {"service": name, "replica": address, "url": url}
        try:
            reply = await client.get(f"{url}/healthz", headers={"Host": parts.netloc})
            body = reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            row.update(status="unreachable", reason=_why(exc))
        else:
            row.update(code=reply.status_code, status=body.get("status", f"HTTP {reply.status_code}"),
                       reason=body.get("reason"), uptime_s=body.get("uptime_s"),
                       facts={k: v for k, v in body.items() if k not in HEALTH_FIELDS})
        rows.append(row)
    return rows


@dataclass
class ServedVersions:
    """What one server of the fleet serves, as the trainer recorded it."""

    policy: int | None = None
    """The whole policy's version; None: none recorded."""
    adapters: dict[str, int] = field(default_factory=dict)
    """Each adapter's (role's) version, by role."""

    def facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"policy_version": self.policy}
        if self.adapters:
            facts["adapter_versions"] = dict(sorted(self.adapters.items()))
        return facts


def versions_by_server(fleet_versions: dict[str, int]) -> dict[str, ServedVersions]:
    """FLEET_VERSIONS' fields (`url`, `<role>@<url>`) grouped by the server they are of."""
    servers: dict[str, ServedVersions] = {}
    for name, version in fleet_versions.items():
        url, adapter = split_version_field(name)
        served = servers.setdefault(url, ServedVersions())
        if adapter is None:
            served.policy = version
        else:
            served.adapters[adapter] = version
    return servers


async def probe_server(client: httpx.AsyncClient, url: str, served: ServedVersions) -> dict[str, Any]:
    """A vLLM server of the fleet: whether its /health answers 200, and the versions it serves."""
    row: dict[str, Any] = {"service": "vllm", "replica": url, "url": url, "facts": served.facts()}
    try:
        reply = await client.get(f"{url.rstrip('/')}/health")
    except httpx.HTTPError as exc:
        row.update(status="unreachable", reason=_why(exc))
    else:
        row.update(code=reply.status_code, status="ok" if reply.status_code == 200 else "not ready",
                   reason=None if reply.status_code == 200 else reply.text[:200])
    return row


async def probe_all(health_urls: dict[str, str], servers: list[str], versions: dict[str, int]) -> list[dict]:
    """Every replica of every named service, then every vLLM server, asked at once. versions: FLEET_VERSIONS
    (bus.fleet_versions())."""
    served = versions_by_server(versions)
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
        services = await asyncio.gather(*(probe_service(client, name, url)
                                          for name, url in health_urls.items()))
        fleet = await asyncio.gather(*(probe_server(client, url, served.get(url, ServedVersions()))
                                       for url in servers))
    return [row for rows in services for row in rows] + list(fleet)
