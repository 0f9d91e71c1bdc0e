"""The gateway's session store for tests: on the test bus's Redis (the machine's, or the local Redis Cluster
where the bus is on it) through an asyncio client of the running event loop, as the gateway holds it.

    async with session_store(bus, redis_url) as store: ...
        planned = await plan(template, store, "s1", request, max_prompt_tokens=4096)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from rollstream.services.gateway.apis.canonical import ChatRequest
from rollstream.services.gateway.prompts import ChatTemplate, History, PlannedTurn, plan_turn
from rollstream.services.gateway.sessions import SessionStore
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.redis_round_trips import connect_round_trips


@contextlib.asynccontextmanager
async def session_store(bus: Bus, redis_url: str, *, ttl_s: int = 600,
                        finish_grace_s: float = 60) -> AsyncIterator[SessionStore]:
    round_trips = connect_round_trips(redis_url, ride_out_outages=False, cluster=bus.settings.cluster)
    store = SessionStore(bus, round_trips, ttl_s, finish_grace_s)
    try:
        yield store
    finally:
        await store.aclose()


async def plan(template: ChatTemplate, store: SessionStore, session_id: str, request: ChatRequest,
               max_prompt_tokens: int, **options) -> PlannedTurn:
    """A turn's prompt as the gateway plans it: the session read with the turns the request's history
    holds."""
    history = History.of(request)
    session = await store.get(session_id, history.answered)
    return await plan_turn(template, store, session, request, history, max_prompt_tokens, **options)
