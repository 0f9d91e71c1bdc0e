"""The run's registry of policy servers in Redis: which vLLM servers serve the policy now, as each says so.

With fleet.registry, a policy server registers once it answers /health (rollstream's plugin in the vLLM
server, vllm_fleet_member.py, which `rollstream serve-policy` turns on) and renews its registration by a
heartbeat until it ends; the fleet's clients (FleetClient.for_run: agent-runners, gateway, trainer) read the
members, route to them and sync them besides fleet.urls. Servers so join and leave a run while it runs
(`docker compose up --scale vllm-cpu=N`, a Kubernetes scale-up) and nothing is restarted.

In Redis (a run fact, run_facts.FLEET_MEMBERS): the set Keys.fleet_members of the urls that registered, and
for each a string Keys.fleet_member(url) holding its group and the version it started on, with a time to live
of fleet.member_ttl_s that every heartbeat renews. A member is one whose string lives: when its heartbeat
stops (the server was killed, its machine is gone), Redis deletes the string on Redis's own clock, so no two
hosts' clocks are ever compared. A server that stops cleanly deregisters at once. Every key is the run's
(`rs:{<run>}:...`): on a Redis Cluster they share the run's hash slot, so one MGET reads every member. No
script is used, so the vLLM server's Redis user needs no more than to write its two keys.

Library module; its tests:
    python -m pytest tests/unit/shared/inference/test_fleet_registry.py -q
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from rollstream.shared.contract.keys import Keys
from rollstream.shared.contract.redis_clients import connect_redis

if TYPE_CHECKING:
    import redis

    from rollstream.shared.runtime.config import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetMember:
    """A policy server as it registered."""

    url: str
    """Where the other services reach it: http://host:port."""
    version: int
    """The policy version it loaded when it started (the fleet's version record says what it serves now)."""
    group: str | None = None
    """The policy group of fleet.groups it belongs to; None: the policy's main servers, fleet.urls'."""
    adapters: tuple[tuple[str, int], ...] = ()
    """In a LoRA run, each role's adapter it loaded when it started, with its version (the fleet's version
    record says what it serves now); not part of its registration."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"a fleet member's url is http(s)://host:port, not {self.url!r}")
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"a fleet member's version is a policy version (0, 1, ...): {self.version!r}")

    def record(self) -> str:
        return json.dumps({"version": self.version, "group": self.group})

    @classmethod
    def from_record(cls, url: str, record: bytes | str) -> FleetMember:
        fields = json.loads(record)
        return cls(url, int(fields["version"]), fields.get("group"))


class FleetRegistry:
    """One run's registered policy servers: register, heartbeat and deregister (a server's side), members (a
    fleet client's)."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a registration's time to live must be positive, not {ttl_s}")
        self.redis = client
        self.keys = keys
        self.ttl_ms = max(1, round(ttl_s * 1000))

    @classmethod
    def for_run(cls, settings: Settings) -> FleetRegistry:
        """The registry of the run `settings` name, on its Redis (a client that rides out an outage)."""
        return cls(connect_redis(settings.redis, cluster=settings.bus.cluster), Keys(settings.run_id),
                   settings.fleet.member_ttl_s)

    @property
    def heartbeat_s(self) -> float:
        """How often a member renews its registration: three beats fit in its time to live, so that one late
        beat does not end it."""
        return self.ttl_ms / 3000

    def register(self, member: FleetMember) -> None:
        """`member` joins the fleet (or renews its registration), for the time to live; the urls of members
        whose registration lapsed are cleared from the set on the way."""
        self.heartbeat(member)
        lapsed = set(self._urls()) - {m.url for m in self.members()}
        if lapsed:
            self.redis.srem(self.keys.fleet_members, *lapsed)
        log.info("a policy server registered in the run's fleet",
                 extra={"server": member.url, "version": member.version, "group": member.group})

    def heartbeat(self, member: FleetMember) -> None:
        """Renews `member`'s registration for the time to live; registers it again if it had lapsed."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self.keys.fleet_member(member.url), member.record(), px=self.ttl_ms)
        pipe.sadd(self.keys.fleet_members, member.url)
        pipe.execute()

    def deregister(self, url: str) -> None:
        """The server at `url` leaves the fleet now (a clean stop), without waiting for its time to live."""
        url = url.rstrip("/")
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.fleet_member(url))
        pipe.srem(self.keys.fleet_members, url)
        pipe.execute()

    def members(self) -> list[FleetMember]:
        """The servers registered now (whose registration lives), by url."""
        urls = sorted(self._urls())
        if not urls:
            return []
        records = self.redis.mget([self.keys.fleet_member(url) for url in urls])
        members = []
        for url, record in zip(urls, records, strict=True):
            if record is None:
                continue  # lapsed: Redis let its registration expire
            try:
                members.append(FleetMember.from_record(url, record))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("a fleet member's registration is not one rollstream wrote; it is left out",
                          extra={"key": self.keys.fleet_member(url), "error": str(exc)})
        return members

    def _urls(self) -> list[str]:
        return [url.decode() if isinstance(url, bytes) else url
                for url in self.redis.smembers(self.keys.fleet_members)]


async def follow_registry(registry: FleetRegistry, interval_s: float,
                          follow: Callable[[list[FleetMember]], None]) -> None:
    """Hands the registry's members to `follow` every interval_s, until cancelled. A reading that fails is
    logged (once until it succeeds again) and the members stay as they were."""
    failing: str | None = None
    while True:
        await asyncio.sleep(interval_s)
        try:
            members = await asyncio.to_thread(registry.members)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if error != failing:
                log.error("the fleet's registry could not be read; the fleet stays as it was",
                          extra={"error": error})
            failing = error
            continue
        failing = None
        follow(members)
