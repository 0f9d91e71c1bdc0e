"""A gateway session with a time budget ends at its budget, on real Redis (the machine's, and a local Redis
Cluster, where the store's transactions run in the run's one slot): its keys expire at its deadline plus the
grace for the finish however busy it was, whether or not anyone finishes it; a finish within the grace
publishes the session, and one that the end overtakes publishes nothing. A session without a budget expires
session_ttl_s after its last request."""

from __future__ import annotations

import asyncio
import time

import pytest

from rollstream.services.gateway.samples import publish_samples
from rollstream.services.gateway.sessions import ROOT, SessionSpec, TurnNode, expires_at, open_sessions
from tests.unit.services.gateway.stores import session_store

BUDGET_S = 0.4
GRACE_S = 0.6


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request):
    fixture = {"redis": "machine_redis_url", "cluster": "redis_cluster_url"}[request.param]
    return request.getfixturevalue(fixture)


async def open_session(store, session_id: str = "s1", budget_s: float | None = BUDGET_S):
    session, _ = await store.create(SessionSpec(rollout_id="r1", group_id="g1", trajectory_id="r1",
                                                session_id=session_id, time_budget_s=budget_s))
    return session


def run(bus, redis_url, scenario, ttl_s: int = 600):
    """The test's coroutine, given a store on the bus's Redis."""
    async def main():
        async with session_store(bus, redis_url, ttl_s=ttl_s, finish_grace_s=GRACE_S) as store:
            await scenario(store)

    asyncio.run(main())


def turn(parent: str = ROOT) -> TurnNode:
    return TurnNode(parent, [1, 2], [3], [-0.1], 0, 0, "stop", "http://vllm", "x", time.time())


def publisher(bus, session, before=lambda: None):
    def publish(pipe, samples) -> None:
        before()
        publish_samples(bus, pipe, session, samples, status="truncated", reward=None, response_text=None,
                        artifacts={}, error=None)
    return publish


def session_keys(bus, session_id: str = "s1") -> list[str]:
    pattern = bus.keys.state("gateway", "session", session_id) + "*"
    return [k.decode() for k in bus.redis.scan_iter(match=pattern, count=1000)]  # every node of a cluster


def sleep_until(at: float) -> None:
    time.sleep(max(0.0, at - time.time()) + 0.05)


def test_a_sessions_keys_expire_at_its_deadline_plus_the_grace_however_busy_it_was(bus, redis_url):
    async def scenario(store):
        session = await open_session(store)
        assert session.ends_at == session.deadline + GRACE_S
        assert await store.add_turn("s1", "a", turn())
        # turns do not push the end out, as they push the idle TTL
        assert await store.add_turn("s1", "b", turn("a"))
        assert len(session_keys(bus)) == 3
        assert (await store.get("s1")).ends_at == session.ends_at
        assert session.ends_at - 0.002 < expires_at(bus, "s1") <= session.ends_at
        assert [s.spec.session_id for s in open_sessions(bus)] == ["s1"]

        sleep_until(session.ends_at)  # nobody finished it: an agent-runner killed mid-episode
        assert session_keys(bus) == [] and await store.get("s1") is None and open_sessions(bus) == []
        assert not store.finish("s1", publisher(bus, session))
        assert bus.read_all("trajectories") == []

    run(bus, redis_url, scenario)


def test_a_finish_after_the_deadline_but_within_the_grace_publishes_the_session(bus, redis_url):
    async def scenario(store):
        session = await open_session(store)
        assert await store.add_turn("s1", "a", turn())
        sleep_until(session.deadline)
        assert (await store.get("s1")).expired()  # turns are refused from here on (403), the finish is not
        assert store.finish("s1", publisher(bus, session))
        events = [d.event.TYPE for d in bus.read_all("trajectories")]
        assert events == ["TrajectoryStarted", "TrajectoryTurn", "TrajectorySegment", "TrajectoryFinished"]
        assert open_sessions(bus) == []
        sleep_until(session.ends_at)  # the finished session's state goes at the same end
        assert session_keys(bus) == []

    run(bus, redis_url, scenario)


def test_a_finish_that_the_end_overtakes_publishes_nothing(bus, redis_url):
    """The finish's transaction watches the session's keys: their expiring before it commits refuses it
    whole, so no sample of a session is published after the session ended."""
    async def scenario(store):
        session = await open_session(store)
        assert await store.add_turn("s1", "a", turn())
        assert not store.finish("s1", publisher(bus, session, before=lambda: sleep_until(session.ends_at)))
        assert bus.read_all("trajectories") == [] and session_keys(bus) == []

    run(bus, redis_url, scenario)


def test_a_session_without_a_budget_expires_its_ttl_after_its_last_request(bus, redis_url):
    async def scenario(store):
        session = await open_session(store, budget_s=None)
        assert session.ends_at is None and (await store.get("s1")).ends_at is None
        await asyncio.sleep(0.3)
        assert await store.add_turn("s1", "a", turn())
        expires = expires_at(bus, "s1")
        assert time.time() + 59 < expires <= time.time() + 60  # counted from the turn, not from the creation
        assert open_sessions(bus)[0].ends_at is None

    run(bus, redis_url, scenario, ttl_s=60)


def test_only_open_sessions_are_listed(bus, redis_url):
    async def scenario(store):
        first = await open_session(store, "s1")
        await open_session(store, "s2")
        assert await store.add_turn("s1", "a", turn())
        assert store.finish("s1", publisher(bus, first))
        assert [s.spec.session_id for s in open_sessions(bus)] == ["s2"]

    run(bus, redis_url, scenario)
