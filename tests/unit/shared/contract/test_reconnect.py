"""Riding out a Redis restart: a service's client waits for Redis and goes on where it was, its
consumer group is made again when Redis came back without it, and /healthz says "not ready" meanwhile.
Against a redis-server each test starts and restarts itself (append-only, as in production)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import pytest
import redis

from rollstream.shared.contract.bus import Bus
from rollstream.shared.contract.events import PromptIssued
from rollstream.shared.runtime.config import BusSettings, Settings
from rollstream.shared.runtime.service import ServiceRuntime
from tests.support import free_port, prompt

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


class RestartableRedis:
    def __init__(self, data_dir, appendonly: bool = True, *extra: str) -> None:
        self.port = free_port()
        self.data_dir = data_dir
        self.appendonly = appendonly
        self.extra = extra
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always", "--save", "",
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.AuthenticationError:
                return  # up, and asking for a password
            except redis.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def server(tmp_path):
    server = RestartableRedis(tmp_path)
    server.start()
    yield server
    server.kill()


def restart_later(server: RestartableRedis, delay_s: float) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), server.start()))
    thread.start()
    return thread


def test_a_consumer_waits_for_a_restarted_redis_and_reads_on_with_its_group_and_pending_entries(server):
    bus = Bus.connect(server.url, "r1", BusSettings(block_ms=50, reclaim_idle_ms=60_000))
    bus.ensure_group("prompts", "agent-runner")
    for index in range(3):
        bus.publish("prompts", prompt(index))
    (first,) = bus.consume("prompts", "agent-runner", "c1", count=1)  # left pending, as by a crashed episode
    server.kill()
    restarted = restart_later(server, 1.5)
    started = time.monotonic()
    more = bus.consume("prompts", "agent-runner", "c1", count=5)  # blocks while Redis is down, then reads on
    restarted.join()
    assert time.monotonic() - started >= 1.0
    assert [d.event.sample_index for d in more] == [1, 2]
    assert all(isinstance(d.event, PromptIssued) for d in more)
    pending = bus.redis.xpending_range(bus.keys.stream("prompts"), "agent-runner", "-", "+", 10)
    assert [row["message_id"].decode() for row in pending] == [first.entry_id, *(d.entry_id for d in more)]


def test_a_redis_that_came_back_without_the_group_gets_it_again(tmp_path):
    server = RestartableRedis(tmp_path, appendonly=False)
    server.start()
    try:
        bus = Bus.connect(server.url, "r1", BusSettings(block_ms=50))
        bus.ensure_group("prompts", "agent-runner")
        server.kill()
        server.start()  # empty: no stream, no group
        assert bus.consume("prompts", "agent-runner", "c1") == []
        bus.publish("prompts", prompt(0))
        assert [d.event.sample_index for d in bus.consume("prompts", "agent-runner", "c1")] == [0]
    finally:
        server.kill()


def test_a_client_for_people_fails_at_once_instead_of_waiting(server):
    bus = Bus.connect(server.url, "r1", ride_out_outages=False)
    server.kill()
    with pytest.raises(redis.ConnectionError):
        bus.redis.ping()
    server.start()


def test_a_refused_login_fails_at_once_instead_of_being_retried_as_an_outage(tmp_path):
    server = RestartableRedis(tmp_path, True, "--requirepass", "the-right-one")
    server.start()
    try:
        bus = Bus.connect(f"redis://:wrong@127.0.0.1:{server.port}/0", "r1")
        started = time.monotonic()
        with pytest.raises(redis.AuthenticationError):
            bus.redis.ping()
        assert time.monotonic() - started < 2
    finally:
        server.kill()


def test_healthz_is_not_ready_while_redis_is_away_and_ready_again_after(server):
    runtime = ServiceRuntime("reward", Settings(redis_url=server.url, health_port=0))
    url = f"http://127.0.0.1:{runtime.health_port}/healthz"
    try:
        assert httpx.get(url).status_code == 200
        server.kill()
        away = httpx.get(url, timeout=5)
        assert away.status_code == 503 and away.json()["reason"].startswith("Redis unreachable")
        server.start()
        assert httpx.get(url).status_code == 200
    finally:
        runtime.close()
