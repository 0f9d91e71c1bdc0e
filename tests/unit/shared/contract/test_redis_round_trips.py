"""connect_round_trips: commands sent in one round trip and their replies, on the machine's Redis; hiredis's
connections give what redis-py's pipeline gives, log in with the URL's user and database, refuse a wrong
password at once, and never hand a connection with unread replies to the next round trip.

    python -m pytest tests/unit/shared/contract/test_redis_round_trips.py -q
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from redis.exceptions import NoScriptError

from rollstream.shared.contract.bus import connect_async_redis
from rollstream.shared.contract.redis_round_trips import (
    HiredisRoundTrips,
    PipelineRoundTrips,
    connect_round_trips,
)

SCRIPT = "return {KEYS[1], ARGV[1]}"


def with_netloc(url: str, credentials: str = "", db: int | None = None) -> str:
    parts = urlsplit(url)
    netloc = f"{credentials}@{parts.hostname}:{parts.port or 6379}" if credentials else parts.netloc
    return urlunsplit(parts._replace(netloc=netloc, path=f"/{db}" if db is not None else parts.path))


async def replies_of(round_trips, key: str) -> list:
    try:
        await round_trips.run(("DEL", key, f"{key}:n"), ("HSET", key, "a", "1", "b", "2"))
        loaded = await round_trips.run(("SCRIPT LOAD", SCRIPT))
        return loaded + await round_trips.run(
            ("HGETALL", key), ("HGETALL", f"{key}:none"), ("HMGET", key, "a", "zz"), ("HGET", key, "b"),
            ("HINCRBY", key, "a", 5), ("EVALSHA", hashlib.sha1(SCRIPT.encode()).hexdigest(), 1, key, "x"),
            ("EVALSHA", "0" * 40, 0), ("DEL", key))
    finally:
        await round_trips.aclose()


def test_hiredis_gives_the_replies_redis_pys_pipeline_gives(machine_redis_url):
    key = f"rs-test:{uuid.uuid4().hex}"
    fast = connect_round_trips(machine_redis_url)
    assert isinstance(fast, HiredisRoundTrips)
    ours = asyncio.run(replies_of(fast, key))
    theirs = asyncio.run(replies_of(PipelineRoundTrips(connect_async_redis(machine_redis_url)), key))
    assert ours[:-2] == theirs[:-2] == [
        hashlib.sha1(SCRIPT.encode()).hexdigest(), {b"a": b"1", b"b": b"2"}, {}, [b"1", None], b"2", 6,
        [key.encode(), b"x"]]
    assert [type(reply) for reply in ours[-2:]] == [NoScriptError, int]
    assert [type(reply) for reply in theirs[-2:]] == [NoScriptError, int]


def test_a_url_with_a_user_and_a_database_is_served_on_them(machine_redis_url):
    admin = redis.Redis.from_url(machine_redis_url)
    user, key = f"rs-test-{uuid.uuid4().hex[:8]}", f"rs-test:{uuid.uuid4().hex}"
    admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["rs-test:*"], commands=["+@all"])

    async def scenario() -> list:
        round_trips = connect_round_trips(with_netloc(machine_redis_url, f"{user}:pw", db=7))
        try:
            return await round_trips.run(("SET", key, "v"), ("ACL", "WHOAMI"), ("GET", "elsewhere"))
        finally:
            await round_trips.aclose()

    try:
        set_reply, whoami, refused = asyncio.run(scenario())
        assert (set_reply, whoami) == (b"OK", user.encode())
        assert isinstance(refused, redis.exceptions.NoPermissionError)
        assert redis.Redis.from_url(with_netloc(machine_redis_url, db=7)).get(key) == b"v"
    finally:
        admin.acl_deluser(user)
        redis.Redis.from_url(with_netloc(machine_redis_url, db=7)).delete(key)


def test_a_wrong_password_is_refused_at_once_though_outages_are_waited_out(machine_redis_url):
    async def scenario() -> None:
        round_trips = connect_round_trips(with_netloc(machine_redis_url, "nobody:wrong"))
        try:
            await asyncio.wait_for(round_trips.run(("PING",)), timeout=30)
        finally:
            await round_trips.aclose()

    with pytest.raises(redis.AuthenticationError):
        asyncio.run(scenario())


def test_a_cancelled_round_trip_leaves_no_reply_for_the_next(machine_redis_url):
    key, empty = f"rs-test:{uuid.uuid4().hex}", f"rs-test:{uuid.uuid4().hex}"

    async def scenario() -> list:
        round_trips = connect_round_trips(machine_redis_url)
        try:
            waiting = asyncio.ensure_future(round_trips.run(("BLPOP", empty, 1)))
            await asyncio.sleep(0.2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            return await round_trips.run(("SET", key, "v"), ("GET", key), ("DEL", key))
        finally:
            await round_trips.aclose()

    assert asyncio.run(scenario()) == [b"OK", b"v", 1]


def redis_pys_pipeline(url: str) -> PipelineRoundTrips:
    return PipelineRoundTrips(connect_async_redis(url))


@pytest.mark.parametrize("connect", [connect_round_trips, redis_pys_pipeline], ids=["hiredis", "pipeline"])
def test_more_round_trips_at_once_than_connections_wait_for_one(machine_redis_url, connect):
    empty = f"rs-test:{uuid.uuid4().hex}"

    async def scenario() -> list:
        round_trips = connect(machine_redis_url)
        try:
            return await asyncio.gather(*(round_trips.run(("BLPOP", empty, 0.1)) for _ in range(200)))
        finally:
            await round_trips.aclose()

    assert asyncio.run(scenario()) == [[None]] * 200
