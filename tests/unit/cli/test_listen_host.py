"""A local run listens on this machine alone: every service's /healthz and /metrics and the gateway's APIs
bind loopback, so nobody else on the network opens gateway sessions against the fleet or reads the metrics.
Real service processes on the local Redis (the fleet is a URL nobody serves: nothing here generates)."""

import socket
import uuid

import psutil
import pytest

from rollstream.cli.local_run import LocalRun
from rollstream.shared.runtime.config import Settings
from tests.support import MODELS


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process listens on."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def addresses_of_other_interfaces() -> list[str]:
    return [a.address for addresses in psutil.net_if_addrs().values() for a in addresses
            if a.family == socket.AF_INET and not a.address.startswith("127.")]


def answers(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.fixture
def local_run(machine_redis_url, tmp_path):
    settings = Settings(run_id=f"listen-{uuid.uuid4().hex[:8]}", redis_url=machine_redis_url,
                        storage_uri=str(tmp_path / "runs"), model={"path": MODELS / "tiny-llama-warm"},
                        recorder={"enabled": False})
    local = LocalRun(settings, services=("dispatcher", "gateway", "reward"), fleet_urls=["http://127.0.0.1:9"])
    try:
        local.start()
        yield local
    finally:
        local.stop()
        if local.bus is not None:
            local.bus.delete_run()


def test_a_local_runs_services_and_gateway_listen_on_loopback_alone(local_run):
    gateway_port = int(local_run.gateway_urls["gateway"].rsplit(":", 1)[1])
    sockets = {name: listening(process.pid) for name, process in local_run.processes.items()}
    for name, bound in sockets.items():
        assert ("127.0.0.1", local_run.health_ports[name]) in bound, (name, bound)
        assert {address for address, _ in bound} == {"127.0.0.1"}, (name, bound)
    assert ("127.0.0.1", gateway_port) in sockets["gateway"]
    ports = [port for bound in sockets.values() for _, port in bound]
    for address in addresses_of_other_interfaces():
        assert not [port for port in ports if answers(address, port)], address
