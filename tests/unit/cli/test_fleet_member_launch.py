"""What `rollstream serve-policy` hands the vLLM server it becomes when the run's fleet has a registry
(cli/vllm_server.py: exec_newest_policy, VllmServer.join_fleet): the member it registers as, with the version
it loads and the URL the other services reach it at, and the settings its registration reads
(shared/inference/vllm_fleet_member.py reads them inside vLLM). The exec itself is caught, so that the test's
process stays itself; tests/integration/test_fleet_registry.py starts real servers that register.

    python -m pytest tests/unit/cli/test_fleet_member_launch.py -q
"""

from __future__ import annotations

import socket

import pytest

from rollstream.cli.vllm_server import advertised_host, exec_newest_policy
from rollstream.shared.contract.events import PolicyUpdated
from rollstream.shared.inference.fleet_registry import FleetMember
from rollstream.shared.inference.vllm_fleet_member import MEMBER_VARIABLE, member_from_environment
from rollstream.shared.runtime.config import Settings


class Exec(Exception):
    """os.execve, caught: the command and environment the process would have become."""


@pytest.fixture
def caught_exec(monkeypatch):
    def execve(path, command, env):
        raise Exec(command, env)

    monkeypatch.setattr("os.execve", execve)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")  # no core lease to hand over


def model_dir(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def became(settings: Settings, port: int = 8000, group: str | None = None) -> dict[str, str]:
    with pytest.raises(Exec) as caught:
        exec_newest_policy(settings, port, group=group)
    _, env = caught.value.args
    return env


def settings_of(bus, redis_url, tmp_path, **fleet) -> Settings:
    return Settings(run_id=bus.keys.run_id, redis_url=redis_url, storage_uri=str(tmp_path / "runs"),
                    model={"path": model_dir(tmp_path / "start")}, listen_host="0.0.0.0",
                    fleet={"urls": [], **fleet})


def test_a_server_of_a_run_with_a_registry_registers_with_the_version_it_loads_at_its_own_address(
        bus, redis_url, tmp_path, caught_exec, monkeypatch):
    checkpoint = model_dir(tmp_path / "runs" / "v3")
    bus.publish("policy", PolicyUpdated(version=3, checkpoint_uri=str(checkpoint), batch_id="b-3", servers=[],
                                        parity_max_abs_diff=0.0, loss=0.0, trained_samples=1))
    bus.redis.sadd(bus.keys.trained_batches, "b-3")
    env = became(settings_of(bus, redis_url, tmp_path, registry=True, member_ttl_s=6), port=8123)
    host = socket.gethostbyname(socket.gethostname())  # what others reach this host (container, pod) at
    assert member_from_environment(env[MEMBER_VARIABLE]) == FleetMember(f"http://{host}:8123", 3)
    for name, value in env.items():  # the settings as the plugin reads them, in the server's environment
        monkeypatch.setenv(name, value)
    read = Settings()
    assert (read.run_id, read.redis_url, read.fleet.registry, read.fleet.member_ttl_s) == (
        bus.keys.run_id, redis_url, True, 6.0)


def test_a_policy_group_server_registers_in_its_group_at_the_advertised_url(
        bus, redis_url, tmp_path, caught_exec):
    settings = settings_of(bus, redis_url, tmp_path, registry=True, advertise_url="http://vllm-long-2.vllm:9000",
                           groups={"long": {"policy": True, "max_model_len": 4096}})
    env = became(settings, port=9000, group="long")
    assert member_from_environment(env[MEMBER_VARIABLE]) == FleetMember("http://vllm-long-2.vllm:9000", 0,
                                                                        group="long")


def test_without_a_registry_a_server_registers_nothing(bus, redis_url, tmp_path, caught_exec):
    assert MEMBER_VARIABLE not in became(settings_of(bus, redis_url, tmp_path, urls=["http://vllm:8000"]))


def test_the_advertised_host_is_the_listening_address_or_for_every_interface_this_hosts_own():
    own = socket.gethostbyname(socket.gethostname())
    assert [advertised_host(host) for host in ("0.0.0.0", "10.1.2.3", "vllm-0.vllm", "::1")] == [
        own, "10.1.2.3", "vllm-0.vllm", "[::1]"]


@pytest.mark.parametrize("value", ["not json", '{"version": 1}', '{"url": "http://a:1", "version": "x"}'])
def test_a_member_variable_that_is_not_a_member_says_what_it_should_be(value):
    with pytest.raises(ValueError, match=f"{MEMBER_VARIABLE}=.* is not the JSON of a fleet member"):
        member_from_environment(value)


def test_a_server_of_a_lora_run_starts_with_each_roles_newest_adapter_and_records_their_versions(
        bus, redis_url, tmp_path, caught_exec):
    """It loads, from the start, each role's newest adapter on the run's storage, and once registered the
    fleet's versions say which version of each it serves."""
    from rollstream.shared.inference.adapter_sync import ADAPTER_WEIGHTS, adapter_dir
    from rollstream.shared.inference.fleet_registry import FleetRegistry
    from rollstream.shared.inference.vllm_fleet_member import join

    settings = settings_of(bus, redis_url, tmp_path, registry=True, advertise_url="http://vllm-1:8000")
    settings = Settings(**{**settings.model_dump(), "roles": {"names": {"planner": {}, "solver": {}}},
                           "train": {"lora_rank": 8}})
    # the run published planner v4 and solver v2; the planner's v5 is written, not published yet (its sync is
    # under way, or its trainer died before publishing it): the server starts with what was published
    bus.publish("policy", PolicyUpdated(version=6, checkpoint_uri=str(tmp_path / "runs" / "v6"),
                                        batch_id="b-6", servers=[], parity_max_abs_diff=0.0, loss=0.0,
                                        trained_samples=1, role_versions={"planner": 4, "solver": 2}))
    bus.redis.sadd(bus.keys.trained_batches, "b-6")
    for role, version in (("planner", 1), ("planner", 4), ("planner", 5), ("solver", 2)):
        directory = adapter_dir(settings.run_dir(), role, version)
        directory.mkdir(parents=True)
        (directory / ADAPTER_WEIGHTS).write_bytes(b"")
    with pytest.raises(Exec) as caught:
        exec_newest_policy(settings, 8000)
    command, env = caught.value.args
    assert command[command.index("--lora-modules") + 1:][:2] == [
        f"planner={adapter_dir(settings.run_dir(), 'planner', 4).resolve()}",
        f"solver={adapter_dir(settings.run_dir(), 'solver', 2).resolve()}"]
    assert command[command.index("--max-loras") + 1] == "2"
    member = member_from_environment(env[MEMBER_VARIABLE])
    assert member == FleetMember("http://vllm-1:8000", 6, adapters=(("planner", 4), ("solver", 2)))
    join(FleetRegistry(bus.redis, bus.keys, ttl_s=30), member)
    assert bus.fleet_versions() == {"http://vllm-1:8000": 6, "planner@http://vllm-1:8000": 4,
                                    "solver@http://vllm-1:8000": 2}
