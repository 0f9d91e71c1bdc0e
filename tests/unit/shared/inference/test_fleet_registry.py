"""The run's registry of policy servers (shared/inference/fleet_registry.py) on the machine's Redis 7.0 and
on a Redis Cluster: a server that registers is a member until its heartbeat stops or it deregisters, and a run
sees its own members only.

    python -m pytest tests/unit/shared/inference/test_fleet_registry.py -q
"""

from __future__ import annotations

import time

import pytest

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.keys import Keys
from rollstream.shared.inference.fleet_registry import FleetMember, FleetRegistry
from tests.support import wait_for

SHORT_TTL_S = 0.3


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request):
    fixture = {"redis": "machine_redis_url", "cluster": "redis_cluster_url"}[request.param]
    return request.getfixturevalue(fixture)


def registry_of(bus: Bus, ttl_s: float = 30.0) -> FleetRegistry:
    return FleetRegistry(bus.redis, bus.keys, ttl_s)


def test_a_registered_server_is_a_member_with_its_version_and_group(bus):
    registry = registry_of(bus)
    registry.register(FleetMember("http://10.0.0.5:8000/", 3))
    registry.register(FleetMember("http://10.0.0.6:8000", 0, group="long"))
    assert registry.members() == [FleetMember("http://10.0.0.5:8000", 3),
                                  FleetMember("http://10.0.0.6:8000", 0, group="long")]
    registry.register(FleetMember("http://10.0.0.5:8000", 3))  # registering again changes nothing
    assert [member.url for member in registry.members()] == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]


def test_a_heartbeat_keeps_a_server_a_member_past_its_time_to_live(bus):
    ttl_s = 1.0  # beats every third of it: a beat late by less than two thirds of a second ends nothing
    registry = registry_of(bus, ttl_s)
    member = FleetMember("http://10.0.0.5:8000", 1)
    registry.register(member)
    beats_until = time.monotonic() + 3 * ttl_s
    while time.monotonic() < beats_until:
        assert registry.members() == [member]
        registry.heartbeat(member)
        time.sleep(registry.heartbeat_s)
    assert registry.members() == [member]


def test_a_server_whose_heartbeat_lapsed_is_no_member_and_leaves_the_set_at_the_next_registration(bus):
    registry = registry_of(bus, SHORT_TTL_S)
    registry.register(FleetMember("http://10.0.0.5:8000", 1))
    kept = FleetMember("http://10.0.0.6:8000", 1)
    registry.register(kept)
    wait_for(lambda: registry.members() == [], 10, "both registrations to lapse")
    assert bus.redis.scard(bus.keys.fleet_members) == 2  # nobody cleared the urls yet

    registry.register(kept)  # comes back: its own registration lives again, the other's url is cleared
    assert registry.members() == [kept]
    assert bus.redis.smembers(bus.keys.fleet_members) == {b"http://10.0.0.6:8000"}


def test_a_heartbeat_after_a_lapse_registers_the_server_again(bus):
    registry = registry_of(bus, SHORT_TTL_S)
    member = FleetMember("http://10.0.0.5:8000", 2, group="long")
    registry.register(member)
    wait_for(lambda: registry.members() == [], 10, "the registration to lapse")
    registry.heartbeat(member)
    assert registry.members() == [member]


def test_a_server_that_deregisters_leaves_at_once(bus):
    registry = registry_of(bus)
    registry.register(FleetMember("http://10.0.0.5:8000", 1))
    registry.register(FleetMember("http://10.0.0.6:8000", 1))
    registry.deregister("http://10.0.0.5:8000/")
    assert [member.url for member in registry.members()] == ["http://10.0.0.6:8000"]
    assert not bus.redis.exists(bus.keys.fleet_member("http://10.0.0.5:8000"))


def test_a_run_sees_its_own_members_only_and_its_deletion_takes_them(bus, run_id):
    ours, theirs = registry_of(bus), FleetRegistry(bus.redis, Keys(f"{run_id}-other"), 30.0)
    ours.register(FleetMember("http://10.0.0.5:8000", 1))
    theirs.register(FleetMember("http://10.0.0.9:8000", 4))
    try:
        assert [member.url for member in ours.members()] == ["http://10.0.0.5:8000"]
        assert [member.url for member in theirs.members()] == ["http://10.0.0.9:8000"]
        assert Keys.run_of(bus.keys.fleet_member("http://10.0.0.5:8000")) == run_id
        bus.delete_run()
        assert ours.members() == [] and len(theirs.members()) == 1
    finally:
        Bus(bus.redis, f"{run_id}-other").delete_run()


def test_a_registration_that_rollstream_did_not_write_is_left_out(bus, caplog):
    registry = registry_of(bus)
    registry.register(FleetMember("http://10.0.0.5:8000", 1))
    bus.redis.sadd(bus.keys.fleet_members, "http://10.0.0.7:8000")
    bus.redis.set(bus.keys.fleet_member("http://10.0.0.7:8000"), "not json")
    assert [member.url for member in registry.members()] == ["http://10.0.0.5:8000"]
    assert "not one rollstream wrote" in caplog.text


@pytest.mark.parametrize("url, version", [("10.0.0.5:8000", 1), ("http://10.0.0.5:8000/v1", 1),
                                          ("http://10.0.0.5:8000", -1), ("http://10.0.0.5:8000", True)])
def test_a_member_is_a_servers_root_url_and_a_policy_version(url, version):
    with pytest.raises(ValueError, match="a fleet member's"):
        FleetMember(url, version)
