"""The gateway's session store for tests: on the test bus's Redis (the machine's, or the local Redis Cluster
where the bus is on it) through an asyncio client of the running event loop, as the gateway holds it.

    async with session_store(bus, redis_url) as store: ...
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from rollstream.services.gateway.sessions import SessionStore
from rollstream.shared.contract.bus import Bus, connect_async_redis


@contextlib.asynccontextmanager
async def session_store(bus: Bus, redis_url: str, *, ttl_s: int = 600,
                        finish_grace_s: float = 60) -> AsyncIterator[SessionStore]:
    client = connect_async_redis(redis_url, ride_out_outages=False, cluster=bus.settings.cluster)
    try:
        yield SessionStore(bus, client, ttl_s, finish_grace_s)
    finally:
        await client.aclose()
