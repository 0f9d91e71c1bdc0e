"""The gateway's session store rides out a Redis restart as every service's client does: a turn's reads and
its record wait, on the event loop, for the restarted Redis, whose append-only file kept the session, and go
on (its scripts loaded again: a restarted Redis has none). Against a redis-server the test starts and
restarts.

    python -m pytest tests/unit/services/gateway/test_session_outage.py -q
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest

from rollstream.services.gateway.sessions import ROOT, SessionSpec, SessionStore, TurnNode
from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.redis_round_trips import connect_round_trips
from tests.unit.shared.contract.test_reconnect import RestartableRedis

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def node(parent: str) -> TurnNode:
    return TurnNode(parent, [1, 2], [3], [-0.1], 0, 0, "stop", "http://vllm", "x", time.time())


def test_a_turn_waits_for_a_restarted_redis_and_goes_on(tmp_path):
    server = RestartableRedis(tmp_path)
    server.start()
    bus = Bus.connect(server.url, "r1")

    async def scenario() -> None:
        store = SessionStore(bus, connect_round_trips(server.url), ttl_s=600, finish_grace_s=60)
        try:
            await store.create(SessionSpec(rollout_id="r1", group_id="g1", trajectory_id="r1",
                                           session_id="s1"))
            assert await store.add_turn("s1", "a", node(ROOT))
            server.kill()
            restart = threading.Timer(1.5, server.start)
            restart.start()
            started = time.monotonic()
            session = await store.get("s1", ["a"])  # waits while Redis is down
            assert time.monotonic() - started >= 1.0
            assert session.turns == 1 and session.status == "open" and list(session.nodes) == ["a"]
            assert await store.add_turn("s1", "b", node("a"))
            assert (await store.get("s1")).turns == 2
            assert [len(chain) for chain in store.samples("s1")] == [2]
            restart.join()
        finally:
            await store.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.kill()
