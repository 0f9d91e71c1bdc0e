"""A fleet client that follows the run's registry (fleet.registry; FleetClient.for_run), on the machine's
Redis with small real HTTP servers that answer as vLLM does: it starts from the servers registered, a server
that registers later is met and takes turns, one that leaves takes none, and the listed servers stay.
Against real vLLM servers that register themselves: tests/integration/test_fleet_registry.py.

    python -m pytest tests/unit/shared/inference/test_fleet_members.py -q
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from rollstream.shared.contract.keys import Keys
from rollstream.shared.inference.fleet import FleetClient, FleetUnavailable
from rollstream.shared.inference.fleet_registry import FleetMember, FleetRegistry
from rollstream.shared.runtime.config import Settings
from tests.support import free_port

REFRESH_S = 0.05


@pytest.fixture
def registry(bus) -> FleetRegistry:
    return FleetRegistry(bus.redis, bus.keys, ttl_s=30)


@pytest.fixture
def settings_of(bus, redis_url):
    """The settings of the bus's run with the registry on: fleet.urls `urls`, further fleet settings."""
    def settings(urls=(), **fleet) -> Settings:
        return Settings(run_id=bus.keys.run_id, redis_url=redis_url,
                        fleet={"registry": True, "urls": list(urls), "members_refresh_s": REFRESH_S, **fleet})

    return settings


async def until(condition, what: str, timeout_s: float = 10.0):
    """Polls condition() on the loop (the client's refresh runs meanwhile) until it holds."""
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def servers_of(fleet: FleetClient, sessions: int = 24) -> set[str]:
    turns = [await fleet.complete([1, 2], max_tokens=1, session_id=f"s{i}") for i in range(sessions)]
    return {turn.server_url for turn in turns}


def test_servers_that_register_join_the_fleet_take_turns_and_leave_when_they_deregister(
        settings_of, registry, servers):
    first, second = servers(), servers()
    registry.register(FleetMember(first.url, 0))

    async def go():
        async with FleetClient.for_run(settings_of()) as fleet:
            assert fleet.urls == [first.url]  # the members when it was made
            assert await servers_of(fleet) == {first.url}

            registry.register(FleetMember(second.url, 2))
            await until(lambda: second.url in fleet.urls, "the second server to join")
            assert await servers_of(fleet) == {first.url, second.url}
            assert second.requests["/v1/models"] == 1  # met before its first turn

            registry.deregister(first.url)
            await until(lambda: first.url not in fleet.urls, "the first server to leave")
            turns_before = first.requests["/v1/completions"]
            assert await servers_of(fleet) == {second.url}
            assert first.requests["/v1/completions"] == turns_before
            assert fleet.in_flight == {second.url: 0} and set(fleet.server_load) == {second.url}

    asyncio.run(go())


def test_with_no_server_registered_a_turn_is_fleet_unavailable_until_one_registers(
        settings_of, registry, servers):
    server = servers()

    async def go():
        async with FleetClient.for_run(settings_of(members_refresh_s=60)) as fleet:
            with pytest.raises(FleetUnavailable, match="no policy server is listed .* or registered"):
                await fleet.complete([1], max_tokens=1, session_id="s")
            registry.register(FleetMember(server.url, 0))
            # read at the turn, not at the next refresh a minute later: a fleet of none looks again
            assert (await fleet.complete([1], max_tokens=1, session_id="s")).server_url == server.url

    asyncio.run(go())


def test_a_member_joins_its_policy_groups_context_and_one_of_an_unknown_group_is_left_out(
        settings_of, registry, servers, caplog):
    main, long, stray = servers(max_model_len=1024), servers(max_model_len=8192), servers()
    registry.register(FleetMember(main.url, 0))
    registry.register(FleetMember(long.url, 0, group="long"))
    registry.register(FleetMember(stray.url, 0, group="judge"))  # a model group, not the policy's
    settings = settings_of(groups={"long": {"policy": True, "max_model_len": 8192},
                                        "judge": {"urls": ["http://judge:8000"]}})

    async def go():
        async with FleetClient.for_run(settings) as fleet:
            await fleet.meet_servers()
            long_turn = await fleet.complete(list(range(3000)), max_tokens=1, session_id="s")
            return sorted(fleet.urls), fleet.contexts, long_turn.server_url

    with caplog.at_level(logging.WARNING):
        urls, contexts, long_turn_server = asyncio.run(go())
    assert urls == sorted([main.url, long.url])
    assert contexts == {main.url: 1024, long.url: 8192} and long_turn_server == long.url
    assert "registered in the policy group 'judge', which fleet.groups does not have" in caplog.text


def test_the_listed_servers_stay_and_a_listed_server_that_registers_is_not_counted_twice(
        settings_of, registry, servers):
    listed, member = servers(), servers()
    registry.register(FleetMember(listed.url, 0))
    registry.register(FleetMember(member.url, 0))

    async def go():
        async with FleetClient.for_run(settings_of(urls=[listed.url])) as fleet:
            assert sorted(fleet.urls) == sorted([listed.url, member.url])
            assert await fleet.meet_servers() == {}  # follows the registry from here on
            registry.deregister(listed.url)
            registry.deregister(member.url)
            await until(lambda: fleet.urls == [listed.url], "the member to leave")
            assert await servers_of(fleet, 4) == {listed.url}

    asyncio.run(go())


def test_without_the_registry_the_fleet_is_the_listed_servers(settings_of, registry, servers):
    listed, member = servers(), servers()
    registry.register(FleetMember(member.url, 0))
    settings = settings_of(urls=[listed.url], registry=False)

    async def go():
        async with FleetClient.for_run(settings) as fleet:
            assert fleet.registry is None and await fleet.refresh_members() == [listed.url]

    asyncio.run(go())


def test_a_registry_that_cannot_be_read_leaves_the_fleet_as_it_was_and_says_so_once(servers, caplog):
    server = servers()
    # nothing listens there; a client that fails at once instead of retrying for a few seconds
    unreachable = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))

    async def go():
        registry = FleetRegistry(unreachable, Keys("r"), ttl_s=30)
        async with FleetClient([server.url], registry=registry, members_refresh_s=REFRESH_S) as fleet:
            await fleet.meet_servers()
            await asyncio.sleep(10 * REFRESH_S)
            return fleet.urls, await servers_of(fleet, 2)

    with caplog.at_level(logging.ERROR):
        urls, served = asyncio.run(go())
    assert urls == [server.url] and served == {server.url}
    assert caplog.text.count("the fleet's registry could not be read") == 1


def test_a_member_that_serves_another_model_is_left_out_and_the_fleet_goes_on_until_it_registers_anew(
        settings_of, registry, servers, caplog):
    good, wrong = servers(), servers(served_name="another-model")
    registry.register(FleetMember(good.url, 0))

    async def go():
        async with FleetClient.for_run(settings_of()) as fleet:
            assert await servers_of(fleet, 2) == {good.url}
            registry.register(FleetMember(wrong.url, 0))
            await until(lambda: wrong.url in fleet.urls, "the wrong server to join")
            assert await servers_of(fleet, 24) == {good.url}  # met at the next turn: every turn still served
            assert fleet.urls == [good.url] and wrong.requests.get("/v1/completions") is None
            await asyncio.sleep(10 * REFRESH_S)
            assert wrong.requests["/v1/models"] == 1  # not met again while it stays registered

            registry.deregister(wrong.url)
            await asyncio.sleep(10 * REFRESH_S)
            wrong.models = good.models  # restarted with the run's model, it registers anew
            registry.register(FleetMember(wrong.url, 0))
            await until(lambda: wrong.url in fleet.urls, "the server to join once it serves the run's model")
            return await servers_of(fleet, 24)

    with caplog.at_level(logging.ERROR):
        assert asyncio.run(go()) == {good.url, wrong.url}
    assert "left out of the fleet" in caplog.text and "does not serve 'tiny'" in caplog.text
